// mpgraph's fused kernels for ONNX Runtime: a custom-op library (domain ``ai.mpgraph``).
//
// AdamWUpdate(p, g, m, v, c1, b2, c2, bc2_sqrt, eps, step_size, decay) -> (p', m', v')
//   m' = m + (g - m) * c1
//   v' = v * b2 + (g * g) * c2
//   p' = p * decay - (m' / (sqrt(v') / bc2_sqrt + eps)) * step_size
// The 14 ONNX ops mpgraph.optim.adam emits for one tensor, in one pass over memory, rounding
// after every operation in the same order (no contraction into fused multiply-adds), so its
// results are bit-identical to the ONNX ops it replaces. The scalars are rank-0 float tensors
// (loss scaling gates some of them on the device). Built for the CPU provider always and for
// the CUDA provider when compiled with MPG_WITH_CUDA (adamw.cu).
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace {

const OrtApi* g_api = nullptr;

OrtStatus* status(const std::string& message) {
  auto create = mpg_slot<OrtStatus* (*)(int, const char*)>(g_api, kCreateStatus);
  return create(MPG_ORT_INVALID_ARGUMENT, message.c_str());
}

struct Tensor {
  float* data = nullptr;
  std::vector<int64_t> dims;
  size_t count = 0;
  int type = 0;
};

OrtStatus* describe(const OrtValue* value, Tensor* out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  OrtStatus* st = mpg_slot<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(g_api, kGetTensorTypeAndShape)(value, &info);
  if (st) return st;
  size_t rank = 0;
  st = mpg_slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(g_api, kGetDimensionsCount)(info, &rank);
  if (!st) {
    out->dims.assign(rank, 0);
    st = mpg_slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(g_api, kGetDimensions)(info, out->dims.data(), rank);
  }
  if (!st) st = mpg_slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(g_api, kGetTensorShapeElementCount)(info, &out->count);
  if (!st) st = mpg_slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int*)>(g_api, kGetTensorElementType)(info, &out->type);
  mpg_slot<void (*)(OrtTensorTypeAndShapeInfo*)>(g_api, kReleaseTensorTypeAndShapeInfo)(info);
  if (st) return st;
  void* data = nullptr;
  st = mpg_slot<OrtStatus* (*)(OrtValue*, void**)>(g_api, kGetTensorMutableData)(const_cast<OrtValue*>(value), &data);
  out->data = static_cast<float*>(data);
  return st;
}

OrtStatus* input(OrtKernelContext* ctx, size_t index, Tensor* out) {
  const OrtValue* value = nullptr;
  OrtStatus* st = mpg_slot<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(g_api, kKernelContext_GetInput)(ctx, index, &value);
  if (st) return st;
  if (!value) return status("AdamWUpdate: input " + std::to_string(index) + " is missing");
  return describe(value, out);
}

OrtStatus* output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& dims, Tensor* out) {
  OrtValue* value = nullptr;
  OrtStatus* st = mpg_slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(g_api, kKernelContext_GetOutput)(
      ctx, index, dims.data(), dims.size(), &value);
  if (st) return st;
  return describe(value, out);
}

}  // namespace

#ifdef MPG_WITH_CUDA
extern "C" size_t mpg_layernorm_grad_chunks(size_t rows);
extern "C" int mpg_layernorm_grad_cuda(const float* dy, const float* x, const float* scale, const float* mean,
                                       const float* inv_std, float* dx, float* dscale, float* partial, size_t rows,
                                       size_t cols, void* stream);
extern "C" int mpg_adamw_cuda(const float* p, const float* g, const float* m, const float* v, const float* const* scalars,
                              float* p_out, float* m_out, float* v_out, size_t n, void* stream);
#endif

namespace {

enum { kAdamInputs = 11, kAdamOutputs = 3, kAdamScalars = 7 };

struct Kernel {
  bool cuda;
};

void adamw_cpu(const float* p, const float* g, const float* m, const float* v, const float* const* s,
               float* po, float* mo, float* vo, size_t n) {
  const float c1 = *s[0], b2 = *s[1], c2 = *s[2], bc2_sqrt = *s[3], eps = *s[4], step_size = *s[5], decay = *s[6];
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float m_new = m[i] + (gi - m[i]) * c1;
    const float gg = gi * gi;
    const float v_new = v[i] * b2 + gg * c2;
    const float denom = std::sqrt(v_new) / bc2_sqrt + eps;
    const float update = (m_new / denom) * step_size;
    const float p_decayed = p[i] * decay;
    po[i] = p_decayed - update;
    mo[i] = m_new;
    vo[i] = v_new;
  }
}

OrtStatus* adamw_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor t[kAdamInputs];
  for (size_t i = 0; i < kAdamInputs; ++i) {
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
    if (t[i].type != MPG_FLOAT) return status("AdamWUpdate: input " + std::to_string(i) + " is not float32");
  }
  const size_t n = t[0].count;
  for (size_t i = 1; i < 4; ++i)
    if (t[i].count != n) return status("AdamWUpdate: p, g, m and v differ in size");
  for (size_t i = 4; i < kAdamInputs; ++i)
    if (t[i].count != 1) return status("AdamWUpdate: input " + std::to_string(i) + " is not a scalar");
  Tensor o[kAdamOutputs];
  for (size_t i = 0; i < kAdamOutputs; ++i)
    if (OrtStatus* st = output(ctx, i, t[0].dims, &o[i])) return st;
  const float* scalars[kAdamScalars];
  for (size_t i = 0; i < kAdamScalars; ++i) scalars[i] = t[4 + i].data;
  if (n == 0) return nullptr;
  if (!cuda) {
    adamw_cpu(t[0].data, t[1].data, t[2].data, t[3].data, scalars, o[0].data, o[1].data, o[2].data, n);
    return nullptr;
  }
#ifdef MPG_WITH_CUDA
  void* stream = nullptr;
  if (OrtStatus* st = mpg_slot<OrtStatus* (*)(const OrtKernelContext*, void**)>(g_api, kKernelContext_GetGPUComputeStream)(ctx, &stream)) return st;
  if (int err = mpg_adamw_cuda(t[0].data, t[1].data, t[2].data, t[3].data, scalars, o[0].data, o[1].data, o[2].data, n, stream))
    return status("AdamWUpdate: CUDA launch failed with error " + std::to_string(err));
  return nullptr;
#else
  return status("AdamWUpdate: this library was built without CUDA");
#endif
}

void layernorm_grad_cpu(const float* dy, const float* x, const float* scale, const float* mean, const float* inv_std,
                        float* dx, float* dscale, size_t rows, size_t cols) {
  for (size_t j = 0; j < cols; ++j) dscale[j] = 0.0f;
  for (size_t r = 0; r < rows; ++r) {
    const float* dyr = dy + r * cols;
    const float* xr = x + r * cols;
    const float mu = mean[r], rs = inv_std[r];
    float s1 = 0.0f, s2 = 0.0f;
    for (size_t j = 0; j < cols; ++j) {
      const float xhat = (xr[j] - mu) * rs;
      const float dxhat = dyr[j] * scale[j];
      s1 += dxhat;
      s2 += dxhat * xhat;
      dscale[j] += dyr[j] * xhat;
    }
    const float m1 = s1 / static_cast<float>(cols), m2 = s2 / static_cast<float>(cols);
    float* dxr = dx + r * cols;
    for (size_t j = 0; j < cols; ++j) {
      const float xhat = (xr[j] - mu) * rs;
      const float dxhat = dyr[j] * scale[j];
      dxr[j] = rs * ((dxhat - m1) - xhat * m2);
    }
  }
}

OrtStatus* layernorm_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor t[5];
  for (size_t i = 0; i < 5; ++i) {
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
    if (t[i].type != MPG_FLOAT) return status("LayerNormGrad: input " + std::to_string(i) + " is not float32");
  }
  const Tensor &dy = t[0], &x = t[1], &scale = t[2], &mean = t[3], &inv_std = t[4];
  if (x.dims.empty()) return status("LayerNormGrad: x is a scalar");
  const size_t cols = static_cast<size_t>(x.dims.back());
  const size_t rows = cols ? x.count / cols : 0;
  if (dy.count != x.count || scale.count != cols || mean.count != rows || inv_std.count != rows)
    return status("LayerNormGrad: dy, x, scale, mean and inv_std disagree in size");
  Tensor dx, dscale, workspace;
  if (OrtStatus* st = output(ctx, 0, x.dims, &dx)) return st;
  if (OrtStatus* st = output(ctx, 1, std::vector<int64_t>{static_cast<int64_t>(cols)}, &dscale)) return st;
  size_t chunks = 0;
#ifdef MPG_WITH_CUDA
  if (cuda) chunks = mpg_layernorm_grad_chunks(rows);
#endif
  if (OrtStatus* st = output(ctx, 2, std::vector<int64_t>{static_cast<int64_t>(chunks), static_cast<int64_t>(cols)}, &workspace))
    return st;
  if (x.count == 0) return nullptr;
  if (!cuda) {
    layernorm_grad_cpu(dy.data, x.data, scale.data, mean.data, inv_std.data, dx.data, dscale.data, rows, cols);
    return nullptr;
  }
#ifdef MPG_WITH_CUDA
  void* stream = nullptr;
  if (OrtStatus* st = mpg_slot<OrtStatus* (*)(const OrtKernelContext*, void**)>(g_api, kKernelContext_GetGPUComputeStream)(ctx, &stream)) return st;
  if (int err = mpg_layernorm_grad_cuda(dy.data, x.data, scale.data, mean.data, inv_std.data, dx.data, dscale.data,
                                        workspace.data, rows, cols, stream))
    return status("LayerNormGrad: CUDA launch failed with error " + std::to_string(err));
  return nullptr;
#else
  return status("LayerNormGrad: this library was built without CUDA");
#endif
}

// -- the ops' callbacks ----------------------------------------------------------------------

const char* kCpu = "CPUExecutionProvider";
const char* kCuda = "CUDAExecutionProvider";

enum Kind { kAdamW = 0, kLayerNormGrad = 1 };

struct Op {
  MpgCustomOp base;
  bool cuda;
  Kind kind;
};

const Op* as_op(const MpgCustomOp* op) { return reinterpret_cast<const Op*>(op); }
const char* op_name(const MpgCustomOp* op) { return as_op(op)->kind == kAdamW ? "AdamWUpdate" : "LayerNormGrad"; }
const char* op_provider(const MpgCustomOp* op) { return as_op(op)->cuda ? kCuda : kCpu; }
int float_type(const MpgCustomOp*, size_t) { return MPG_FLOAT; }
size_t op_inputs(const MpgCustomOp* op) { return as_op(op)->kind == kAdamW ? kAdamInputs : 5; }
size_t op_outputs(const MpgCustomOp* op) { return as_op(op)->kind == kAdamW ? kAdamOutputs : 3; }
void* create_kernel_v1(const MpgCustomOp*, const OrtApi*, const OrtKernelInfo*) { return nullptr; }
void compute_v1(void*, OrtKernelContext*) {}
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
int required(const MpgCustomOp*, size_t) { return 0; }
int default_memory(const MpgCustomOp*, size_t) { return 0; }
int one(const MpgCustomOp*) { return 1; }
int zero(const MpgCustomOp*) { return 0; }
OrtStatus* create_kernel(const MpgCustomOp* op, const OrtApi*, const OrtKernelInfo*, void** kernel) {
  *kernel = new Kernel{as_op(op)->cuda};
  return nullptr;
}
int start_version(const MpgCustomOp*) { return 1; }
int end_version(const MpgCustomOp*) { return 2147483647; }

Op make_op(Kind kind, bool cuda) {
  Op op;
  std::memset(&op, 0, sizeof(op));
  op.base.version = MPG_ORT_API_VERSION;
  op.base.CreateKernel = create_kernel_v1;
  op.base.GetName = op_name;
  op.base.GetExecutionProviderType = op_provider;
  op.base.GetInputType = float_type;
  op.base.GetInputTypeCount = op_inputs;
  op.base.GetOutputType = float_type;
  op.base.GetOutputTypeCount = op_outputs;
  op.base.KernelCompute = compute_v1;
  op.base.KernelDestroy = destroy;
  op.base.GetInputCharacteristic = required;
  op.base.GetOutputCharacteristic = required;
  op.base.GetInputMemoryType = default_memory;
  op.base.GetVariadicInputMinArity = one;
  op.base.GetVariadicInputHomogeneity = zero;
  op.base.GetVariadicOutputMinArity = one;
  op.base.GetVariadicOutputHomogeneity = zero;
  op.base.CreateKernelV2 = create_kernel;
  op.base.KernelComputeV2 = kind == kAdamW ? adamw_compute : layernorm_grad_compute;
  op.base.InferOutputShapeFn = nullptr;
  op.base.GetStartVersion = start_version;
  op.base.GetEndVersion = end_version;
  op.cuda = cuda;
  op.kind = kind;
  return op;
}

Op g_ops[] = {
    make_op(kAdamW, false), make_op(kLayerNormGrad, false),
#ifdef MPG_WITH_CUDA
    make_op(kAdamW, true), make_op(kLayerNormGrad, true),
#endif
};

}  // namespace

extern "C" {

// Which providers this build has kernels for (the Python side reads it with ctypes).
__attribute__((visibility("default"))) int MpgraphKernelsHaveCuda() {
#ifdef MPG_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(MPG_ORT_API_VERSION);
  if (!api) return nullptr;  // an ORT older than 1.17: nothing registered, the graph keeps the plain ops
  g_api = api;
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = mpg_slot<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(api, kCreateCustomOpDomain)("ai.mpgraph", &domain)) return st;
  auto add = mpg_slot<OrtStatus* (*)(OrtCustomOpDomain*, const MpgCustomOp*)>(api, kCustomOpDomain_Add);
  for (Op& op : g_ops)
    if (OrtStatus* st = add(domain, &op.base)) return st;
  return mpg_slot<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(api, kAddCustomOpDomain)(options, domain);
}

}  // extern "C"
