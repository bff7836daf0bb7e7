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
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "multi.h"
#include "ort_abi.h"
#include "pointwise.h"
#include "sdpa.h"
#include "gemm_bias.h"
#include "gemm_fp8.h"
#include "rotary.h"

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

// An optional input: ``*present`` says whether the node has it (``out`` described only then).
OrtStatus* optional_input(OrtKernelContext* ctx, size_t index, Tensor* out, bool* present) {
  size_t count = 0;
  mpg_slot<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(g_api, kKernelContext_GetInputCount)(ctx, &count);
  const OrtValue* value = nullptr;
  if (count > index)
    if (OrtStatus* st = mpg_slot<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(g_api, kKernelContext_GetInput)(ctx, index, &value)) return st;
  *present = value != nullptr;
  return value ? describe(value, out) : nullptr;
}

OrtStatus* output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& dims, Tensor* out) {
  OrtValue* value = nullptr;
  OrtStatus* st = mpg_slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(g_api, kKernelContext_GetOutput)(
      ctx, index, dims.data(), dims.size(), &value);
  if (st) return st;
  return describe(value, out);
}

// The CPU loops below are written so that the compiler vectorizes them (-fno-math-errno lets
// sqrt vectorize); every lane rounds each operation as a scalar would, so the results do not
// depend on the vector width. Where the build allows it (GCC or clang on x86-64, outside nvcc)
// each loop is compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__) && !defined(__APPLE__)
#define MPG_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MPG_CPU_CLONES
#endif

// Elements one CPU task takes: large enough to amortise a task, small enough to spread a
// tensor of a few hundred thousand elements over the session's threads.
constexpr size_t kCpuChunk = 32768;

void run_task(void* fn, size_t i) { (*static_cast<const std::function<void(size_t)>*>(fn))(i); }

// Run fn(0..total-1) on the session's intra-op thread pool (ORT's KernelContext_ParallelFor);
// one task runs inline.
OrtStatus* parallel_for(OrtKernelContext* ctx, size_t total, const std::function<void(size_t)>& fn) {
  if (total <= 1) {
    for (size_t i = 0; i < total; ++i) fn(i);
    return nullptr;
  }
  using ParallelFor = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
  return mpg_slot<ParallelFor>(g_api, kKernelContext_ParallelFor)(ctx, run_task, total, 0,
                                                                  const_cast<std::function<void(size_t)>*>(&fn));
}

// fn(begin, end) over [0, n) in kCpuChunk pieces on the thread pool.
OrtStatus* parallel_chunks(OrtKernelContext* ctx, size_t n, const std::function<void(size_t, size_t)>& fn) {
  const size_t tasks = (n + kCpuChunk - 1) / kCpuChunk;
  return parallel_for(ctx, tasks, [&](size_t t) { fn(t * kCpuChunk, std::min(n, (t + 1) * kCpuChunk)); });
}

// A CUDA launch written at a call site as MPG_CUDA(mpg_x_cuda(..., stream)) inside on_gpu's
// lambda: the call itself in a CUDA build; in a CPU-only one, where the mpg_*_cuda functions do
// not exist, 0 (on_gpu never runs it there).
#ifdef MPG_WITH_CUDA
#define MPG_CUDA(...) __VA_ARGS__
#else
#define MPG_CUDA(...) ((void)stream, 0)
#endif

// Run launch(stream) on the session's CUDA compute stream; a non-zero CUDA error from it, or a
// library built without CUDA, is an error status naming the op.
template <typename Launch>
OrtStatus* on_gpu(OrtKernelContext* ctx, const std::string& name, Launch launch) {
#ifdef MPG_WITH_CUDA
  void* stream = nullptr;
  using GetStream = OrtStatus* (*)(const OrtKernelContext*, void**);
  if (OrtStatus* st = mpg_slot<GetStream>(g_api, kKernelContext_GetGPUComputeStream)(ctx, &stream)) return st;
  if (int err = launch(stream)) return status(name + ": CUDA launch failed with error " + std::to_string(err));
  return nullptr;
#else
  (void)ctx;
  (void)launch;
  return status(name + ": this library was built without CUDA");
#endif
}

// on_gpu, where a nonzero return of ``launch`` comes with a message from its CUDA file (``error()``,
// that file's last error): the status names the op and gives that message.
template <typename Launch, typename Error>
OrtStatus* on_gpu_or(OrtKernelContext* ctx, const std::string& name, Launch launch, Error error) {
  std::string why;
  OrtStatus* st = on_gpu(ctx, name, [&](void* stream) {
    const int rc = launch(stream);
    if (rc) why = error();
    return rc;
  });
  if (st && !why.empty()) {
    mpg_slot<void (*)(OrtStatus*)>(g_api, kReleaseStatus)(st);
    return status(name + ": " + why);
  }
  return st;
}

}  // namespace

#ifdef MPG_WITH_CUDA
extern "C" size_t mpg_layernorm_grad_chunks(size_t rows);
extern "C" int mpg_layernorm_grad_cuda(int dy_type, const void* dy, const float* x, const float* scale,
                                       const float* mean, const float* inv_std, float* dx, float* dscale, float* dbias,
                                       float* partial, size_t rows, size_t cols, void* stream);
extern "C" int mpg_adamw_cuda(const float* p, const float* g, const float* m, const float* v, const float* const* scalars,
                              float* p_out, float* m_out, float* v_out, size_t n, void* stream);
#endif

namespace {

enum { kAdamInputs = 11, kAdamOutputs = 3, kAdamScalars = 7 };

struct OpSpec;

// Pointwise's program and outputs, parsed from its attributes when the kernel is made.
struct PointwisePlan {
  PwProgram program;
  std::vector<int> out_reg;
  std::vector<std::vector<int64_t>> out_dims;
  std::string error;  // a malformed attribute, reported by compute
};

struct Kernel {
  bool cuda;
  const OpSpec* spec;
  // SdpaForward/SdpaBackward's attributes (read when the kernel is made; other ops keep these).
  bool has_scale = false;  // false: 1/sqrt(head_dim)
  float scale = 0.0f;
  int64_t causal = 0, q_heads = 0, kv_heads = 0;
  // SoftmaxCrossEntropyRows(Grad)'s attributes.
  int64_t ce_valid_cols = 0, ce_ignore_index = 0, ce_has_ignore = 0, ce_reduction = 0;
  // Pointwise's program.
  std::shared_ptr<PointwisePlan> pw;
  // GemmBias's attributes.
  int64_t gemm_trans_a = 0, gemm_trans_b = 0;
  float gemm_alpha = 1.0f;
  // RotaryEmbedding's attributes.
  int64_t rot_interleaved = 0, rot_dim = 0, rot_heads = 0, rot_neg_sin = 0;
  // CastToFloat8*Amax: the cast writes the amax too.
  bool cast_amax = false;
};

MPG_CPU_CLONES void adamw_cpu(const float* __restrict p, const float* __restrict g, const float* __restrict m,
                              const float* __restrict v, const float* const* s, float* __restrict po,
                              float* __restrict mo, float* __restrict vo, size_t n) {
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
    return parallel_chunks(ctx, n, [&](size_t a, size_t b) {
      adamw_cpu(t[0].data + a, t[1].data + a, t[2].data + a, t[3].data + a, scalars, o[0].data + a, o[1].data + a,
                o[2].data + a, b - a);
    });
  }
  return on_gpu(ctx, "AdamWUpdate", [&](void* stream) {
    return MPG_CUDA(mpg_adamw_cuda(t[0].data, t[1].data, t[2].data, t[3].data, scalars, o[0].data, o[1].data, o[2].data,
                                   n, stream));
  });
}

float load_cpu(const void* p, int type, size_t k);  // float, float16 or bfloat16 element k, as float

// LayerNormGrad(dy, x, scale, mean, inv_std) -> (dx, dscale, workspace), dy float32;
// LayerNormGradBias: the same with dbias = ReduceSum(dy) over the leading axes, and dy float32,
// float16 or bfloat16 (the cast to float32 before it in the graph happens on load):
// -> (dx, dscale, dbias, workspace).
// Rows [r0, r1): dx, and this block's sums of dscale and dbias into part (2 * cols floats).
void layernorm_grad_rows(const Tensor& dy, const float* x, const float* scale, const float* mean, const float* inv_std,
                         float* dx, float* part, bool bias, size_t r0, size_t r1, size_t cols) {
  float* dscale = part;
  float* dbias = part + cols;
  std::vector<float> dyr(cols);
  for (size_t r = r0; r < r1; ++r) {
    for (size_t j = 0; j < cols; ++j) dyr[j] = load_cpu(dy.data, dy.type, r * cols + j);
    const float* xr = x + r * cols;
    const float mu = mean[r], rs = inv_std[r];
    float s1 = 0.0f, s2 = 0.0f;
    for (size_t j = 0; j < cols; ++j) {
      const float xhat = (xr[j] - mu) * rs;
      const float dxhat = dyr[j] * scale[j];
      s1 += dxhat;
      s2 += dxhat * xhat;
      dscale[j] += dyr[j] * xhat;
      if (bias) dbias[j] += dyr[j];
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

// Blocks of rows on the thread pool, each summing its own dscale/dbias partials; the partials
// are then added in block order (a fixed order: the result does not depend on the threads).
OrtStatus* layernorm_grad_cpu(OrtKernelContext* ctx, const Tensor& dy, const float* x, const float* scale, const float* mean,
                              const float* inv_std, float* dx, float* dscale, float* dbias, size_t rows, size_t cols) {
  const size_t per = std::max<size_t>(1, kCpuChunk / std::max<size_t>(cols, 1));
  const size_t blocks = (rows + per - 1) / per;
  std::vector<float> parts(blocks * 2 * cols, 0.0f);
  OrtStatus* st = parallel_for(ctx, blocks, [&](size_t b) {
    layernorm_grad_rows(dy, x, scale, mean, inv_std, dx, parts.data() + b * 2 * cols, dbias != nullptr, b * per,
                        std::min(rows, (b + 1) * per), cols);
  });
  if (st) return st;
  for (size_t j = 0; j < cols; ++j) {
    float ds = 0.0f, db = 0.0f;
    for (size_t b = 0; b < blocks; ++b) {
      ds += parts[b * 2 * cols + j];
      db += parts[b * 2 * cols + cols + j];
    }
    dscale[j] = ds;
    if (dbias) dbias[j] = db;
  }
  return nullptr;
}

OrtStatus* layernorm_grad_compute(void* kernel, OrtKernelContext* ctx, bool bias) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  const std::string name = bias ? "LayerNormGradBias" : "LayerNormGrad";
  Tensor t[5];
  for (size_t i = 0; i < 5; ++i) {
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
    const bool low_dy = bias && i == 0 && (t[i].type == MPG_FLOAT16 || t[i].type == MPG_BFLOAT16);
    if (t[i].type != MPG_FLOAT && !low_dy) return status(name + ": input " + std::to_string(i) + " has an unsupported type");
  }
  const Tensor &dy = t[0], &x = t[1], &scale = t[2], &mean = t[3], &inv_std = t[4];
  if (x.dims.empty()) return status(name + ": x is a scalar");
  const size_t cols = static_cast<size_t>(x.dims.back());
  const size_t rows = cols ? x.count / cols : 0;
  if (dy.count != x.count || scale.count != cols || mean.count != rows || inv_std.count != rows)
    return status(name + ": dy, x, scale, mean and inv_std disagree in size");
  Tensor dx, dscale, dbias, workspace;
  const std::vector<int64_t> vec{static_cast<int64_t>(cols)};
  if (OrtStatus* st = output(ctx, 0, x.dims, &dx)) return st;
  if (OrtStatus* st = output(ctx, 1, vec, &dscale)) return st;
  if (bias)
    if (OrtStatus* st = output(ctx, 2, vec, &dbias)) return st;
  size_t chunks = 0;
#ifdef MPG_WITH_CUDA
  if (cuda) chunks = mpg_layernorm_grad_chunks(rows) * (bias ? 2 : 1);
#endif
  if (OrtStatus* st = output(ctx, bias ? 3 : 2, std::vector<int64_t>{static_cast<int64_t>(chunks), static_cast<int64_t>(cols)}, &workspace))
    return st;
  if (x.count == 0) return nullptr;
  if (!cuda) {
    return layernorm_grad_cpu(ctx, dy, x.data, scale.data, mean.data, inv_std.data, dx.data, dscale.data,
                              bias ? dbias.data : nullptr, rows, cols);
  }
  return on_gpu(ctx, name, [&](void* stream) {
    return MPG_CUDA(mpg_layernorm_grad_cuda(dy.type, dy.data, x.data, scale.data, mean.data, inv_std.data, dx.data,
                                            dscale.data, bias ? dbias.data : nullptr, workspace.data, rows, cols,
                                            stream));
  });
}

OrtStatus* layernorm_grad_plain(void* k, OrtKernelContext* c) { return layernorm_grad_compute(k, c, false); }
OrtStatus* layernorm_grad_bias(void* k, OrtKernelContext* c) { return layernorm_grad_compute(k, c, true); }

// -- multi-tensor ops (multi.h; CUDA in multi.cu) ---------------------------------------------
//
// MultiAdamWUpdate(c1, b2, c2, bc2_sqrt, eps, step_size, decay, p_1, g_1, m_1, v_1, ...)
//     -> (p_1', m_1', v_1', ...): AdamWUpdate over many tensors sharing the scalars.
// CastToBFloat16(x_1, ...) -> (y_1, ...), CastToFloat16(...): float32 casts, rounded to nearest
//     even as ORT's Cast does.
// UnscaleGradients(inv_scale, g_1, ...) -> (found_inf, u_1, ...): u_i = float(g_i) * inv_scale,
//     or zeros in every u_i when any entry of any u_i is not finite (found_inf then true).

uint16_t float_to_bfloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>(((bits >> 16) & 0x8000) | 0x7FC0);  // ORT: the sign, a quiet NaN
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t float_to_float16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7FFFFFFF;
  if (x > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00);  // NaN
  if (x >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (x < 0x38800000) {  // a float16 subnormal or zero: round x * 2^24 to an integer, ties to even
    float scaled;
    const uint32_t ax = x;
    std::memcpy(&scaled, &ax, 4);
    scaled = std::nearbyint(scaled * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(scaled));
  }
  const uint32_t rounded = x + 0x0FFF + ((x >> 13) & 1) - 0x38000000;
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(mant), -24);
    uint32_t bits;
    std::memcpy(&bits, &out, 4);
    bits |= sign;
    std::memcpy(&out, &bits, 4);
    return out;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000 | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  std::memcpy(&out, &bits, 4);
  return out;
}

float load_cpu(const void* p, int type, size_t k) {  // declared above the LayerNorm kernels
  if (type == kTypeFloat16) return half_to_float(static_cast<const uint16_t*>(p)[k]);
  if (type == kTypeBFloat16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[k]) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
  }
  return static_cast<const float*>(p)[k];
}

// Elements [a, b) of one tensor of a multi-tensor AdamW or cast.
void multi_cpu_range(int op, const MultiBatch& batch, const MultiTensor& t, size_t a, size_t b) {
  if (op == kMultiAdamW) {
    adamw_cpu(static_cast<const float*>(t.in[0]) + a, static_cast<const float*>(t.in[1]) + a,
              static_cast<const float*>(t.in[2]) + a, static_cast<const float*>(t.in[3]) + a, batch.scalars,
              static_cast<float*>(t.out[0]) + a, static_cast<float*>(t.out[1]) + a, static_cast<float*>(t.out[2]) + a,
              b - a);
    return;
  }
  const float* x = static_cast<const float*>(t.in[0]);
  uint16_t* y = static_cast<uint16_t*>(t.out[0]);
  for (size_t k = a; k < b; ++k) y[k] = op == kMultiCastBFloat16 ? float_to_bfloat16(x[k]) : float_to_float16(x[k]);
}

// A multi-tensor op on the CPU: AdamW and the casts in kCpuChunk pieces on the thread pool;
// the unscale (a check over every tensor before any output) on the calling thread.
OrtStatus* multi_cpu(OrtKernelContext* ctx, int op, const MultiBatch& batch) {
  if (op == kMultiUnscale) {
    const float inv = *batch.scalars[0];
    bool found = false;
    for (int j = 0; j < batch.count; ++j)
      for (size_t k = 0; k < batch.tensors[j].n && !found; ++k)
        found = !std::isfinite(load_cpu(batch.tensors[j].in[0], batch.tensors[j].type, k) * inv);
    *batch.found = found;
    for (int j = 0; j < batch.count; ++j) {
      const MultiTensor& t = batch.tensors[j];
      float* u = static_cast<float*>(t.out[0]);
      for (size_t k = 0; k < t.n; ++k) u[k] = found ? 0.0f : load_cpu(t.in[0], t.type, k) * inv;
    }
    return nullptr;
  }
  std::vector<std::pair<int, size_t>> tasks;  // (tensor, first element)
  for (int j = 0; j < batch.count; ++j)
    for (size_t a = 0; a < batch.tensors[j].n; a += kCpuChunk) tasks.emplace_back(j, a);
  return parallel_for(ctx, tasks.size(), [&](size_t i) {
    const MultiTensor& t = batch.tensors[tasks[i].first];
    multi_cpu_range(op, batch, t, tasks[i].second, std::min(t.n, tasks[i].second + kCpuChunk));
  });
}

const char* multi_name(int op) {
  static const char* names[] = {"MultiAdamWUpdate", "CastToBFloat16", "CastToFloat16", "UnscaleGradients"};
  return names[op];
}

size_t input_count(OrtKernelContext* ctx) {
  size_t n = 0;
  mpg_slot<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(g_api, kKernelContext_GetInputCount)(ctx, &n);
  return n;
}

// The scalars (AdamW's seven, the unscale's inverse scale) ahead of the tensors.
OrtStatus* read_scalars(OrtKernelContext* ctx, int op, size_t count, MultiBatch* batch) {
  for (size_t i = 0; i < count; ++i) {
    Tensor s;
    if (OrtStatus* st = input(ctx, i, &s)) return st;
    if (s.type != MPG_FLOAT || s.count != 1)
      return status(std::string(multi_name(op)) + ": input " + std::to_string(i) + " is not a float32 scalar");
    batch->scalars[i] = s.data;
  }
  return nullptr;
}

// One tensor of the batch: its inputs (``per`` of them from ``first``) and outputs.
OrtStatus* read_tensor(OrtKernelContext* ctx, int op, size_t first, size_t per, size_t out_first, MultiTensor* t) {
  Tensor in[4];
  for (size_t k = 0; k < per; ++k) {
    if (OrtStatus* st = input(ctx, first + k, &in[k])) return st;
    const bool low_ok = op == kMultiUnscale && (in[k].type == MPG_FLOAT16 || in[k].type == MPG_BFLOAT16);
    if (in[k].type != MPG_FLOAT && !low_ok)
      return status(std::string(multi_name(op)) + ": input " + std::to_string(first + k) + " has an unsupported type");
    if (in[k].count != in[0].count)
      return status(std::string(multi_name(op)) + ": p, g, m and v differ in size (tensor at input " + std::to_string(first) + ")");
    t->in[k] = in[k].data;
  }
  const size_t outs = op == kMultiAdamW ? 3 : 1;
  for (size_t k = 0; k < outs; ++k) {
    Tensor o;
    if (OrtStatus* st = output(ctx, out_first + k, in[0].dims, &o)) return st;
    t->out[k] = o.data;
  }
  t->n = in[0].count;
  t->type = in[0].type;
  return nullptr;
}

OrtStatus* multi_compute(void* kernel, OrtKernelContext* ctx, int op) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  const size_t scalars = op == kMultiAdamW ? 7 : op == kMultiUnscale ? 1 : 0;
  const size_t per = op == kMultiAdamW ? 4 : 1, outs = op == kMultiAdamW ? 3 : 1;
  const size_t inputs = input_count(ctx);
  if (inputs < scalars + per || (inputs - scalars) % per != 0)
    return status(std::string(multi_name(op)) + ": wrong number of inputs (" + std::to_string(inputs) + ")");
  MultiBatch batch;
  std::memset(&batch, 0, sizeof(batch));
  if (OrtStatus* st = read_scalars(ctx, op, scalars, &batch)) return st;
  std::vector<MultiTensor> tensors((inputs - scalars) / per);
  const size_t out_first = op == kMultiUnscale ? 1 : 0;
  for (size_t j = 0; j < tensors.size(); ++j)
    if (OrtStatus* st = read_tensor(ctx, op, scalars + j * per, per, out_first + j * outs, &tensors[j])) return st;
  batch.tensors = tensors.data();
  batch.count = static_cast<int>(tensors.size());
  if (op == kMultiUnscale) {
    Tensor found;
    if (OrtStatus* st = output(ctx, 0, std::vector<int64_t>{}, &found)) return st;
    batch.found = reinterpret_cast<bool*>(found.data);
  }
  if (!cuda) return multi_cpu(ctx, op, batch);
  return on_gpu(ctx, multi_name(op), [&](void* stream) {
    return MPG_CUDA(mpg_multi_cuda(op, &batch, stream));
  });
}

OrtStatus* multi_adamw_compute(void* k, OrtKernelContext* c) { return multi_compute(k, c, kMultiAdamW); }
OrtStatus* cast_bf16_compute(void* k, OrtKernelContext* c) { return multi_compute(k, c, kMultiCastBFloat16); }
OrtStatus* cast_f16_compute(void* k, OrtKernelContext* c) { return multi_compute(k, c, kMultiCastFloat16); }
OrtStatus* unscale_compute(void* k, OrtKernelContext* c) { return multi_compute(k, c, kMultiUnscale); }

// -- ErfGelu / ErfGeluGrad (CUDA in gelu.cu) --------------------------------------------------
//
// ErfGelu(x, div, one, half) -> y: y = x * (half * (erf(x / div) + one))
// ErfGeluGrad(dy, x, div, one, half, k) -> dx: dx = dy * (cdf + (s / exp(s * s)) * k), with
//     s = x / div and cdf = half * (erf(s) + one) recomputed from x.
// The erf GELU the torch exporters write and mpgraph's autodiff rule differentiates, in float32,
// float16 or bfloat16 (the scalars are of x's type; each step rounds to it). CPU: float32.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_gelu_cuda(int type, const void* dy, const void* x, void* out, size_t n, const void* const* consts,
                             void* stream);
#endif

void gelu_cpu(const float* dy, const float* x, float* out, size_t n, const float* const* c) {
  const float div = *c[0], one = *c[1], half = *c[2], k = dy ? *c[3] : 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float s = x[i] / div;
    const float cdf = half * (std::erf(s) + one);
    if (!dy) {
      out[i] = x[i] * cdf;
      continue;
    }
    const float ex = std::exp(s * s);
    out[i] = dy[i] * (cdf + (s / ex) * k);
  }
}

OrtStatus* gelu_compute(void* kernel, OrtKernelContext* ctx, bool grad) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  const char* name = grad ? "ErfGeluGrad" : "ErfGelu";
  const size_t count = grad ? 6 : 4, first = grad ? 1 : 0;
  Tensor t[6];
  for (size_t i = 0; i < count; ++i)
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
  for (size_t i = 0; i < count; ++i)
    if (t[i].type != t[first].type) return status(std::string(name) + ": inputs differ in type");
  const Tensor& x = t[first];
  if (grad && t[0].count != x.count) return status("ErfGeluGrad: dy and x differ in size");
  for (size_t i = first + 1; i < count; ++i)
    if (t[i].count != 1) return status(std::string(name) + ": input " + std::to_string(i) + " is not a scalar");
  Tensor out;
  if (OrtStatus* st = output(ctx, 0, x.dims, &out)) return st;
  if (x.count == 0) return nullptr;
  const void* consts[4] = {t[first + 1].data, t[first + 2].data, t[first + 3].data, grad ? t[5].data : nullptr};
  if (!cuda) {
    if (x.type != MPG_FLOAT) return status(std::string(name) + ": the CPU kernel is float32 only");
    const float* const* c = reinterpret_cast<const float* const*>(consts);
    const float* dy = grad ? t[0].data : nullptr;
    return parallel_chunks(ctx, x.count, [&](size_t a, size_t b) {
      gelu_cpu(dy ? dy + a : nullptr, x.data + a, out.data + a, b - a, c);
    });
  }
  return on_gpu(ctx, name, [&](void* stream) {
    return MPG_CUDA(mpg_gelu_cuda(x.type, grad ? t[0].data : nullptr, x.data, out.data, x.count, consts, stream));
  });
}

OrtStatus* gelu_forward_compute(void* k, OrtKernelContext* c) { return gelu_compute(k, c, false); }
OrtStatus* gelu_grad_compute(void* k, OrtKernelContext* c) { return gelu_compute(k, c, true); }

// -- TanhGeluGrad (CUDA in gelu.cu) ----------------------------------------------------------
//
// TanhGeluGrad(dy, x, c, ck, ck3, one, half) -> dx: the backward of Gelu(approximate="tanh") as
// mpgraph's autodiff rule writes it, op by op: x2 = x * x; t = tanh(x * (c + x2 * ck));
// dx = dy * (half * (one + t) + (half * x) * ((one - t * t) * (c + x2 * ck3))), with
// c = sqrt(2/pi), ck = c * 0.044715 and ck3 = 3 * ck. Float32, float16 or bfloat16 (the scalars
// are of x's type; each step rounds to it). CPU: float32.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_tanh_gelu_grad_cuda(int type, const void* dy, const void* x, void* dx, size_t n,
                                       const void* const* consts, void* stream);
#endif

void tanh_gelu_grad_cpu(const float* dy, const float* x, float* dx, size_t n, const float* const* k) {
  const float c = *k[0], ck = *k[1], ck3 = *k[2], one = *k[3], half = *k[4];
  for (size_t i = 0; i < n; ++i) {
    const float x2 = x[i] * x[i];
    const float t = std::tanh(x[i] * (c + x2 * ck));
    const float dinner = c + x2 * ck3;
    dx[i] = dy[i] * (half * (one + t) + (half * x[i]) * ((one - t * t) * dinner));
  }
}

OrtStatus* tanh_gelu_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor t[7];
  for (size_t i = 0; i < 7; ++i)
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
  for (size_t i = 1; i < 7; ++i)
    if (t[i].type != t[0].type) return status("TanhGeluGrad: inputs differ in type");
  const Tensor& x = t[1];
  if (t[0].count != x.count) return status("TanhGeluGrad: dy and x differ in size");
  for (size_t i = 2; i < 7; ++i)
    if (t[i].count != 1) return status("TanhGeluGrad: input " + std::to_string(i) + " is not a scalar");
  Tensor out;
  if (OrtStatus* st = output(ctx, 0, x.dims, &out)) return st;
  if (x.count == 0) return nullptr;
  const void* consts[5] = {t[2].data, t[3].data, t[4].data, t[5].data, t[6].data};
  if (!cuda) {
    if (x.type != MPG_FLOAT) return status("TanhGeluGrad: the CPU kernel is float32 only");
    const float* const* c = reinterpret_cast<const float* const*>(consts);
    return parallel_chunks(ctx, x.count, [&](size_t a, size_t b) {
      tanh_gelu_grad_cpu(t[0].data + a, x.data + a, out.data + a, b - a, c);
    });
  }
  return on_gpu(ctx, "TanhGeluGrad", [&](void* stream) {
    return MPG_CUDA(mpg_tanh_gelu_grad_cuda(x.type, t[0].data, x.data, out.data, x.count, consts, stream));
  });
}

// -- SoftmaxGradDot (CUDA in softmax.cu) ---------------------------------------------------
//
// SoftmaxGradDot(dP, P, dO, O) -> dS: the backward of P = Softmax(S) over the last axis, for an
// attention whose output is O = P V, written with sum_j dP_ij P_ij = sum_d dO_id O_id (mpgraph's
// autodiff rule for this pattern): dS = P * (dP - delta), delta_i = sum_d dO_id * O_id summed in
// float then rounded to T. P and dP are [..., rows, keys]; dO and O [..., rows, dim]. CPU: float32.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_softmax_grad_dot_cuda(int type, const void* dp, const void* p, const void* dout, const void* out,
                                         void* ds, size_t rows, size_t keys, size_t dim, void* stream);
#endif

void softmax_grad_dot_cpu(const float* dp, const float* p, const float* dout, const float* out, float* ds, size_t r0,
                          size_t r1, size_t keys, size_t dim) {
  for (size_t r = r0; r < r1; ++r) {
    float delta = 0.0f;
    for (size_t j = 0; j < dim; ++j) delta += dout[r * dim + j] * out[r * dim + j];
    for (size_t j = 0; j < keys; ++j) ds[r * keys + j] = p[r * keys + j] * (dp[r * keys + j] - delta);
  }
}

OrtStatus* softmax_grad_dot_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor t[4];
  for (size_t i = 0; i < 4; ++i)
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
  const Tensor &dp = t[0], &p = t[1], &dout = t[2], &out = t[3];
  for (size_t i = 1; i < 4; ++i)
    if (t[i].type != dp.type) return status("SoftmaxGradDot: inputs differ in type");
  if (p.dims.empty() || out.dims.empty()) return status("SoftmaxGradDot: P or O is a scalar");
  const size_t keys = static_cast<size_t>(p.dims.back()), dim = static_cast<size_t>(out.dims.back());
  const size_t rows = keys ? p.count / keys : 0;
  if (dp.count != p.count || dout.count != out.count || (dim ? out.count / dim : 0) != rows)
    return status("SoftmaxGradDot: dP, P, dO and O disagree in size");
  Tensor ds;
  if (OrtStatus* st = output(ctx, 0, p.dims, &ds)) return st;
  if (p.count == 0) return nullptr;
  if (!cuda) {
    if (p.type != MPG_FLOAT) return status("SoftmaxGradDot: the CPU kernel is float32 only");
    const size_t per = std::max<size_t>(1, kCpuChunk / std::max<size_t>(keys + dim, 1));
    return parallel_for(ctx, (rows + per - 1) / per, [&](size_t b) {
      softmax_grad_dot_cpu(dp.data, p.data, dout.data, out.data, ds.data, b * per, std::min(rows, (b + 1) * per), keys, dim);
    });
  }
  return on_gpu(ctx, "SoftmaxGradDot", [&](void* stream) {
    return MPG_CUDA(mpg_softmax_grad_dot_cuda(p.type, dp.data, p.data, dout.data, out.data, ds.data, rows, keys, dim,
                                              stream));
  });
}

// -- RmsNormGrad / SwiGluGrad (CUDA in rmsnorm.cu, swiglu.cu) -------------------------------
//
// RmsNormGrad(x, scale, eps, dy...) -> (dx, dscale, workspace): the backward of RMSNormalization
//     over the last axis as its gradient rule writes it, with r = 1 / sqrt(mean(x^2) + eps) per
//     row, xhat = x * r, dxhat = dy * scale: dx = r * (dxhat - xhat * mean(dxhat * xhat)),
//     dscale = sum over rows of dy * xhat. x, scale, eps (a scalar), dx, dscale and the workspace
//     (nothing reads it: r and the CUDA column partials) are float32 (the CUDA code is templated
//     on x's type; float32 is what the policies make). dy is 1 to 4 parts of x's size, float32,
//     float16 or bfloat16 each, added in order after widening: the Sum (and the Casts to float32
//     before it) that made the rule's dy.
// RmsNormGradAdd(x, scale, eps, addend, dy...) -> (dx + addend, dscale, workspace): the same, dx
//     added to a float32 addend of x's size (the residual stream's gradient, which the graph's
//     two-input Sum added to dx: the same bits, a + b being b + a).
// SwiGluGrad(dy, a, b, s) -> (da, db): the backward of y = (a * s) * b, s = Sigmoid(a), as the
//     Mul and Sigmoid rules write it, each step rounded to T: h = a * s, db = dy * h,
//     dh = dy * b, da = dh * s + (dh * a) * (s * (1 - s)), the last sum in float32.
//     Float32, float16 or bfloat16 (CPU: float32).
// SwiGlu(a, b) -> (y, s): the forward, s = Sigmoid(a) as ORT's CUDA kernel writes it
//     (a > 0 ? 1 / (1 + exp(-|a|)) : 1 - 1 / (1 + exp(-|a|)), each step in T), y = (a * s) * b.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_swiglu_cuda(int type, const void* a, const void* b, void* y, void* s, size_t n, void* stream);
extern "C" size_t mpg_rmsnorm_grad_workspace(size_t rows, size_t cols);
extern "C" int mpg_rmsnorm_grad_cuda(int type, int parts, const void* const* dy, const int* dy_types, const void* x,
                                     const void* scale, const float* eps, const void* addend, void* dx, void* dscale,
                                     float* work, size_t rows, size_t cols, void* stream);
extern "C" int mpg_swiglu_grad_cuda(int type, const void* dy, const void* a, const void* b, const void* s, void* da,
                                    void* db, size_t n, void* stream);
#endif

constexpr size_t kMaxDyParts = 4;

// Rows [r0, r1): dx and r, and this block's dscale sums into part (cols floats); dy is the
// parts' sum, widened and added in order.
void rmsnorm_grad_rows(const Tensor* dy, size_t parts, const float* x, const float* scale, float eps, const float* addend,
                       float* dx, float* rstd, float* part, size_t r0, size_t r1, size_t cols) {
  std::vector<float> dyr(cols);
  for (size_t row = r0; row < r1; ++row) {
    for (size_t j = 0; j < cols; ++j) {
      float v = load_cpu(dy[0].data, dy[0].type, row * cols + j);
      for (size_t k = 1; k < parts; ++k) v += load_cpu(dy[k].data, dy[k].type, row * cols + j);
      dyr[j] = v;
    }
    const float* xr = x + row * cols;
    float sq = 0.0f;
    for (size_t j = 0; j < cols; ++j) sq += xr[j] * xr[j];
    const float rs = 1.0f / std::sqrt(sq / static_cast<float>(cols) + eps);
    float acc = 0.0f;
    for (size_t j = 0; j < cols; ++j) {
      const float xhat = xr[j] * rs;
      acc += (dyr[j] * scale[j]) * xhat;
      part[j] += dyr[j] * xhat;
    }
    const float m = acc / static_cast<float>(cols);
    float* dxr = dx + row * cols;
    for (size_t j = 0; j < cols; ++j) dxr[j] = rs * ((dyr[j] * scale[j]) - (xr[j] * rs) * m);
    if (addend)
      for (size_t j = 0; j < cols; ++j) dxr[j] += addend[row * cols + j];
    rstd[row] = rs;
  }
}

OrtStatus* rmsnorm_grad_impl(void* kernel, OrtKernelContext* ctx, bool add) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  size_t count = 0;
  if (OrtStatus* st = mpg_slot<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(g_api, kKernelContext_GetInputCount)(ctx, &count))
    return st;
  const size_t first = add ? 4 : 3;  // the first part of dy
  if (count <= first || count - first > kMaxDyParts) return status("RmsNormGrad: takes 1 to 4 parts of dy");
  const size_t parts = count - first;
  Tensor t[4 + kMaxDyParts];
  for (size_t i = 0; i < count; ++i)
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
  const Tensor &x = t[0], &scale = t[1];
  if (x.dims.empty() || t[2].count != 1) return status("RmsNormGrad: x is a scalar or eps is not one");
  const size_t cols = static_cast<size_t>(x.dims.back()), rows = cols ? x.count / cols : 0;
  if (scale.count != cols) return status("RmsNormGrad: scale is not one row of x");
  const void* dy[kMaxDyParts];
  int dy_types[kMaxDyParts];
  for (size_t k = 0; k < parts; ++k) {
    if (t[first + k].count != x.count) return status("RmsNormGrad: a part of dy differs from x in size");
    dy[k] = t[first + k].data;
    dy_types[k] = t[first + k].type;
  }
  const float* addend = add ? t[3].data : nullptr;
  if (add && t[3].count != x.count) return status("RmsNormGradAdd: the addend differs from x in size");
#ifdef MPG_WITH_CUDA
  const size_t work = cuda ? mpg_rmsnorm_grad_workspace(rows, cols) : rows;
#else
  const size_t work = rows;
#endif
  Tensor dx, dscale, ws;
  if (OrtStatus* st = output(ctx, 0, x.dims, &dx)) return st;
  if (OrtStatus* st = output(ctx, 1, scale.dims, &dscale)) return st;
  if (OrtStatus* st = output(ctx, 2, {static_cast<int64_t>(work)}, &ws)) return st;
  if (cols == 0) return nullptr;
  if (!cuda) {
    const float eps = *t[2].data;
    const size_t per = std::max<size_t>(1, kCpuChunk / cols), blocks = (rows + per - 1) / per;
    std::vector<float> sums(blocks * cols, 0.0f);
    OrtStatus* st = parallel_for(ctx, blocks, [&](size_t b) {
      rmsnorm_grad_rows(t + first, parts, x.data, scale.data, eps, addend, dx.data, ws.data, sums.data() + b * cols,
                        b * per, std::min(rows, (b + 1) * per), cols);
    });
    if (st) return st;
    for (size_t j = 0; j < cols; ++j) {
      float sum = 0.0f;
      for (size_t b = 0; b < blocks; ++b) sum += sums[b * cols + j];
      dscale.data[j] = sum;
    }
    return nullptr;
  }
  return on_gpu(ctx, "RmsNormGrad", [&](void* stream) {  // eps stays on the device: the kernel reads it
    return MPG_CUDA(mpg_rmsnorm_grad_cuda(x.type, static_cast<int>(parts), dy, dy_types, x.data, scale.data, t[2].data,
                                          addend, dx.data, dscale.data, ws.data, rows, cols, stream));
  });
}

OrtStatus* rmsnorm_grad_compute(void* k, OrtKernelContext* c) { return rmsnorm_grad_impl(k, c, false); }
OrtStatus* rmsnorm_grad_add_compute(void* k, OrtKernelContext* c) { return rmsnorm_grad_impl(k, c, true); }

void swiglu_cpu(const float* a, const float* b, float* y, float* s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float q = 1.0f / (1.0f + std::exp(-std::fabs(a[i])));
    s[i] = a[i] > 0.0f ? q : 1.0f - q;
    y[i] = (a[i] * s[i]) * b[i];
  }
}

OrtStatus* swiglu_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor a, b;
  if (OrtStatus* st = input(ctx, 0, &a)) return st;
  if (OrtStatus* st = input(ctx, 1, &b)) return st;
  if (a.type != b.type || a.count != b.count) return status("SwiGlu: a and b differ");
  Tensor y, s;
  if (OrtStatus* st = output(ctx, 0, a.dims, &y)) return st;
  if (OrtStatus* st = output(ctx, 1, a.dims, &s)) return st;
  if (a.count == 0) return nullptr;
  if (!cuda) {
    if (a.type != MPG_FLOAT) return status("SwiGlu: the CPU kernel is float32 only");
    return parallel_chunks(ctx, a.count, [&](size_t lo, size_t hi) {
      swiglu_cpu(a.data + lo, b.data + lo, y.data + lo, s.data + lo, hi - lo);
    });
  }
  return on_gpu(ctx, "SwiGlu", [&](void* stream) {
    return MPG_CUDA(mpg_swiglu_cuda(a.type, a.data, b.data, y.data, s.data, a.count, stream));
  });
}

void swiglu_grad_cpu(const float* dy, const float* a, const float* b, const float* s, float* da, float* db, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float h = a[i] * s[i];
    db[i] = dy[i] * h;
    const float dh = dy[i] * b[i];
    const float ds = dh * a[i];
    da[i] = dh * s[i] + ds * (s[i] * (1.0f - s[i]));
  }
}

OrtStatus* swiglu_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor t[4];
  for (size_t i = 0; i < 4; ++i)
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
  for (size_t i = 1; i < 4; ++i)
    if (t[i].type != t[0].type || t[i].count != t[0].count) return status("SwiGluGrad: dy, a, b and s differ");
  Tensor da, db;
  if (OrtStatus* st = output(ctx, 0, t[1].dims, &da)) return st;
  if (OrtStatus* st = output(ctx, 1, t[2].dims, &db)) return st;
  const size_t n = t[0].count;
  if (n == 0) return nullptr;
  if (!cuda) {
    if (t[0].type != MPG_FLOAT) return status("SwiGluGrad: the CPU kernel is float32 only");
    return parallel_chunks(ctx, n, [&](size_t lo, size_t hi) {
      swiglu_grad_cpu(t[0].data + lo, t[1].data + lo, t[2].data + lo, t[3].data + lo, da.data + lo, db.data + lo, hi - lo);
    });
  }
  return on_gpu(ctx, "SwiGluGrad", [&](void* stream) {
    return MPG_CUDA(mpg_swiglu_grad_cuda(t[0].type, t[0].data, t[1].data, t[2].data, t[3].data, da.data, db.data, n, stream));
  });
}

// -- ReluGrad / SoftmaxCrossEntropyGrad (CUDA in grads.cu) -----------------------------------
//
// ReluGrad(dy, x) -> dx = dy * (x > 0 ? 1 : 0): the Relu rule's Mul(dy, Cast(Greater(x, 0))),
//     float32, float16 or bfloat16 (CPU: float32).
// SoftmaxCrossEntropyGrad(log_prob, index, scale) -> (exp(log_prob) - OneHot(index)) * scale:
//     the SoftmaxCrossEntropyLoss rule's logits gradient, [rows, classes] float32, index int64
//     [rows], scale one per row ([rows] or [rows, 1]) or one for all.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_relu_grad_cuda(int type, const void* dy, const void* x, void* dx, size_t n, void* stream);
extern "C" int mpg_sce_grad_cuda(const float* log_prob, const int64_t* index, const float* scale, float* d, size_t rows,
                                 size_t classes, bool scale_per_row, void* stream);
#endif

// The mask is a value multiplied in every lane, as the Mul does: written as a select of the
// product (x > 0 ? dy * 1 : dy * 0), GCC kept a branch around the multiply (it may not run a
// multiply the source skips, -ftrapping-math), mispredicted on half of a Relu's inputs: 6 ns
// an element, 8x the three ORT ops it replaces.
MPG_CPU_CLONES void relu_grad_cpu(const float* __restrict dy, const float* __restrict x, float* __restrict dx, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float mask = static_cast<float>(x[i] > 0.0f);
    dx[i] = dy[i] * mask;
  }
}

OrtStatus* relu_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor dy, x, dx;
  if (OrtStatus* st = input(ctx, 0, &dy)) return st;
  if (OrtStatus* st = input(ctx, 1, &x)) return st;
  if (dy.type != x.type || dy.count != x.count) return status("ReluGrad: dy and x differ in type or size");
  if (OrtStatus* st = output(ctx, 0, x.dims, &dx)) return st;
  if (x.count == 0) return nullptr;
  if (!cuda) {
    if (x.type != MPG_FLOAT) return status("ReluGrad: the CPU kernel is float32 only");
    return parallel_chunks(ctx, x.count, [&](size_t a, size_t b) { relu_grad_cpu(dy.data + a, x.data + a, dx.data + a, b - a); });
  }
  return on_gpu(ctx, "ReluGrad", [&](void* stream) {
    return MPG_CUDA(mpg_relu_grad_cuda(x.type, dy.data, x.data, dx.data, x.count, stream));
  });
}

OrtStatus* sce_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor lp, index, scale, d;
  if (OrtStatus* st = input(ctx, 0, &lp)) return st;
  if (OrtStatus* st = input(ctx, 1, &index)) return st;
  if (OrtStatus* st = input(ctx, 2, &scale)) return st;
  if (lp.dims.size() != 2 || lp.type != MPG_FLOAT || scale.type != MPG_FLOAT)
    return status("SoftmaxCrossEntropyGrad: log_prob must be float32 [rows, classes], scale float32");
  const size_t rows = static_cast<size_t>(lp.dims[0]), classes = static_cast<size_t>(lp.dims[1]);
  if (index.count != rows || (scale.count != rows && scale.count != 1))
    return status("SoftmaxCrossEntropyGrad: index or scale disagrees with log_prob's rows");
  const bool per_row = scale.count == rows && rows != 1;
  if (OrtStatus* st = output(ctx, 0, lp.dims, &d)) return st;
  if (lp.count == 0) return nullptr;
  const int64_t* idx = reinterpret_cast<const int64_t*>(index.data);
  if (!cuda) {
    for (size_t r = 0; r < rows; ++r) {
      int64_t hot = idx[r];
      if (hot < 0) hot += static_cast<int64_t>(classes);
      const float s = scale.data[per_row ? r : 0];
      for (size_t c = 0; c < classes; ++c)
        d.data[r * classes + c] = (std::exp(lp.data[r * classes + c]) - (hot == static_cast<int64_t>(c) ? 1.0f : 0.0f)) * s;
    }
    return nullptr;
  }
  return on_gpu(ctx, "SoftmaxCrossEntropyGrad", [&](void* stream) {
    return MPG_CUDA(mpg_sce_grad_cuda(lp.data, idx, scale.data, d.data, rows, classes, per_row, stream));
  });
}

// -- SoftmaxCrossEntropyRows / SoftmaxCrossEntropyRowsGrad (CUDA in cross_entropy.cu) --------
//
// SoftmaxCrossEntropyRows(logits, labels) -> (loss, stats, count): SoftmaxCrossEntropyLoss over
//     the rows of logits [..., cols] (T: float32; CUDA also float16, bfloat16) whose first
//     ``valid_cols`` columns are the classes (0: all; the rest is a padded GEMM's zero columns),
//     labels int64 [rows]. Attributes: valid_cols, ignore_index (absent: none ignored),
//     reduction 0 mean, 1 sum, 2 none. stats float32 [rows, 2] = (max, log(sum exp(x - max)))
//     per row, count float32 [] = the rows whose label is not ignore_index; loss float32 as the
//     ONNX op's (mean over the kept rows, sum, or [rows]), -((x[label] - max) - logsum) per row.
// SoftmaxCrossEntropyRowsGrad(logits, labels, stats, count, dloss) -> dlogits (T, logits' shape):
//     (exp((x - max) - logsum) - OneHot(Where(kept, label, 0))) * scale in the valid columns,
//     zero in the padding; scale = dloss / count (mean), dloss (sum) or dloss[row] (none), times
//     Cast(kept) with an ignore_index: the SoftmaxCrossEntropyLoss gradient rule's operations,
//     in float32, rounded to T once. A negative label counts from the end (OneHot's rule); one
//     out of range makes a NaN loss and no hot entry.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_ce_rows_cuda(int type, const void* logits, const int64_t* labels, float* loss, float* stats,
                                float* count, size_t rows, size_t cols, size_t valid, int64_t ignore, bool has_ignore,
                                int reduction, void* stream);
extern "C" int mpg_ce_rows_grad_cuda(int type, const void* logits, const int64_t* labels, const float* stats,
                                     const float* count, const float* dloss, void* dx, size_t rows, size_t cols,
                                     size_t valid, int64_t ignore, bool has_ignore, int reduction, void* stream);
#endif

enum { kCeMean = 0, kCeSum = 1, kCeNone = 2, kCeInt64 = 7 /* ONNX's INT64 */ };

// rows, cols and valid columns of a SoftmaxCrossEntropyRows(Grad)'s logits, checked.
OrtStatus* ce_shape(const Kernel* k, const char* name, const Tensor& logits, const Tensor& labels, size_t* rows,
                    size_t* cols, size_t* valid) {
  if (logits.dims.empty() || labels.type != kCeInt64) return status(std::string(name) + ": logits is a scalar or labels are not int64");
  *cols = static_cast<size_t>(logits.dims.back());
  *rows = *cols ? logits.count / *cols : 0;
  *valid = k->ce_valid_cols > 0 ? static_cast<size_t>(k->ce_valid_cols) : *cols;
  if (*valid > *cols || labels.count != *rows || k->ce_reduction < kCeMean || k->ce_reduction > kCeNone)
    return status(std::string(name) + ": valid_cols exceeds the columns, labels disagree with the rows, or reduction is not 0-2");
  return nullptr;
}

OrtStatus* ce_rows_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = static_cast<Kernel*>(kernel);
  Tensor logits, labels, loss, stats, count;
  if (OrtStatus* st = input(ctx, 0, &logits)) return st;
  if (OrtStatus* st = input(ctx, 1, &labels)) return st;
  size_t rows = 0, cols = 0, valid = 0;
  if (OrtStatus* st = ce_shape(k, "SoftmaxCrossEntropyRows", logits, labels, &rows, &cols, &valid)) return st;
  const std::vector<int64_t> loss_dims = k->ce_reduction == kCeNone ? std::vector<int64_t>{static_cast<int64_t>(rows)}
                                                                     : std::vector<int64_t>{};
  if (OrtStatus* st = output(ctx, 0, loss_dims, &loss)) return st;
  if (OrtStatus* st = output(ctx, 1, {static_cast<int64_t>(rows), 2}, &stats)) return st;
  if (OrtStatus* st = output(ctx, 2, {}, &count)) return st;
  // No rows (an empty batch) still writes count 0 and the loss (mean: 0 / 0, NaN, as ORT's op
  // gives when every label is ignored).
  const int64_t* idx = reinterpret_cast<const int64_t*>(labels.data);
  const int64_t ignore = k->ce_ignore_index;
  const bool has_ignore = k->ce_has_ignore != 0;
  if (!k->cuda) {
    if (logits.type != MPG_FLOAT) return status("SoftmaxCrossEntropyRows: the CPU kernel is float32 only");
    const size_t per = std::max<size_t>(1, kCpuChunk / std::max<size_t>(cols, 1));
    OrtStatus* st = parallel_for(ctx, (rows + per - 1) / per, [&](size_t b) {
      for (size_t r = b * per; r < std::min(rows, (b + 1) * per); ++r) {
        const float* x = logits.data + r * cols;
        float m = -INFINITY, s = 0.0f;
        for (size_t j = 0; j < valid; ++j) m = std::max(m, x[j]);
        if (m != -INFINITY)
          for (size_t j = 0; j < valid; ++j) s += std::exp(x[j] - m);
        stats.data[2 * r] = m;
        stats.data[2 * r + 1] = std::log(s);
      }
    });
    if (st) return st;
    float sum = 0.0f, kept = 0.0f;
    for (size_t r = 0; r < rows; ++r) {
      float term = 0.0f;
      if (!has_ignore || idx[r] != ignore) {
        const int64_t c = idx[r] < 0 ? idx[r] + static_cast<int64_t>(valid) : idx[r];
        term = c >= 0 && c < static_cast<int64_t>(valid)
                   ? -((logits.data[r * cols + c] - stats.data[2 * r]) - stats.data[2 * r + 1]) : NAN;
        sum += term;
        kept += 1.0f;
      }
      if (k->ce_reduction == kCeNone) loss.data[r] = term;
    }
    *count.data = kept;
    if (k->ce_reduction == kCeMean) *loss.data = sum / kept;
    if (k->ce_reduction == kCeSum) *loss.data = sum;
    return nullptr;
  }
  return on_gpu(ctx, "SoftmaxCrossEntropyRows", [&](void* stream) {
    return MPG_CUDA(mpg_ce_rows_cuda(logits.type, logits.data, idx, loss.data, stats.data, count.data, rows, cols, valid,
                                     ignore, has_ignore, static_cast<int>(k->ce_reduction), stream));
  });
}

OrtStatus* ce_rows_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = static_cast<Kernel*>(kernel);
  Tensor logits, labels, stats, count, dloss, dx;
  if (OrtStatus* st = input(ctx, 0, &logits)) return st;
  if (OrtStatus* st = input(ctx, 1, &labels)) return st;
  if (OrtStatus* st = input(ctx, 2, &stats)) return st;
  if (OrtStatus* st = input(ctx, 3, &count)) return st;
  if (OrtStatus* st = input(ctx, 4, &dloss)) return st;
  size_t rows = 0, cols = 0, valid = 0;
  if (OrtStatus* st = ce_shape(k, "SoftmaxCrossEntropyRowsGrad", logits, labels, &rows, &cols, &valid)) return st;
  if (stats.count != 2 * rows || count.count != 1 || dloss.count != (k->ce_reduction == kCeNone ? rows : 1))
    return status("SoftmaxCrossEntropyRowsGrad: stats, count or dloss disagree with the rows and the reduction");
  if (OrtStatus* st = output(ctx, 0, logits.dims, &dx)) return st;
  if (rows == 0) return nullptr;
  const int64_t* idx = reinterpret_cast<const int64_t*>(labels.data);
  const int64_t ignore = k->ce_ignore_index;
  const bool has_ignore = k->ce_has_ignore != 0;
  const int reduction = static_cast<int>(k->ce_reduction);
  if (!k->cuda) {
    if (logits.type != MPG_FLOAT) return status("SoftmaxCrossEntropyRowsGrad: the CPU kernel is float32 only");
    const size_t per = std::max<size_t>(1, kCpuChunk / std::max<size_t>(cols, 1));
    return parallel_for(ctx, (rows + per - 1) / per, [&](size_t b) {
      for (size_t r = b * per; r < std::min(rows, (b + 1) * per); ++r) {
        const bool kept = !has_ignore || idx[r] != ignore;
        int64_t hot = kept ? idx[r] : 0;
        if (hot < 0) hot += static_cast<int64_t>(valid);
        float scale = reduction == kCeMean ? *dloss.data / *count.data : dloss.data[reduction == kCeNone ? r : 0];
        if (has_ignore) scale = scale * (kept ? 1.0f : 0.0f);
        const float m = stats.data[2 * r], logsum = stats.data[2 * r + 1];
        const float* x = logits.data + r * cols;
        float* d = dx.data + r * cols;
        for (size_t j = 0; j < cols; ++j)
          d[j] = j < valid ? (std::exp((x[j] - m) - logsum) - (hot == static_cast<int64_t>(j) ? 1.0f : 0.0f)) * scale
                           : 0.0f;
      }
    });
  }
  return on_gpu(ctx, "SoftmaxCrossEntropyRowsGrad", [&](void* stream) {
    return MPG_CUDA(mpg_ce_rows_grad_cuda(logits.type, logits.data, idx, stats.data, count.data, dloss.data, dx.data,
                                          rows, cols, valid, ignore, has_ignore, reduction, stream));
  });
}

// -- AdamScalars (CUDA in grads.cu) ---------------------------------------------------------
//
// AdamScalars(t, lr, beta1, beta2, one) -> (step_size, bc2_sqrt): Adam's bias-corrected
// scalars, t and lr float32 scalars, beta1, beta2 and one float64 scalars:
//   step_size = float(double(lr) / (one - beta1^double(t))), bc2_sqrt = float(sqrt(one - beta2^double(t)))
// The ten ONNX ops mpgraph.optim.adam writes for them, as one launch.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_adam_scalars_cuda(const float* t, const float* lr, const double* b1, const double* b2,
                                     const double* one, float* step_size, float* bc2_sqrt, void* stream);
#endif

OrtStatus* adam_scalars_compute(void* kernel, OrtKernelContext* ctx) {
  const bool cuda = static_cast<Kernel*>(kernel)->cuda;
  Tensor in[5];
  for (size_t i = 0; i < 5; ++i) {
    if (OrtStatus* st = input(ctx, i, &in[i])) return st;
    if (in[i].count != 1 || in[i].type != (i < 2 ? MPG_FLOAT : MPG_DOUBLE))
      return status("AdamScalars: input " + std::to_string(i) + " is not a scalar of the expected type");
  }
  Tensor step_size, bc2_sqrt;
  if (OrtStatus* st = output(ctx, 0, in[0].dims, &step_size)) return st;
  if (OrtStatus* st = output(ctx, 1, in[0].dims, &bc2_sqrt)) return st;
  const double* b1 = reinterpret_cast<const double*>(in[2].data);
  const double* b2 = reinterpret_cast<const double*>(in[3].data);
  const double* one = reinterpret_cast<const double*>(in[4].data);
  if (!cuda) {
    const double t64 = static_cast<double>(*in[0].data);
    const double bc1 = *one - std::pow(*b1, t64), bc2 = *one - std::pow(*b2, t64);
    *step_size.data = static_cast<float>(static_cast<double>(*in[1].data) / bc1);
    *bc2_sqrt.data = static_cast<float>(std::sqrt(bc2));
    return nullptr;
  }
  return on_gpu(ctx, "AdamScalars", [&](void* stream) {
    return MPG_CUDA(mpg_adam_scalars_cuda(in[0].data, in[1].data, b1, b2, one, step_size.data, bc2_sqrt.data, stream));
  });
}

// -- Permute (CPU only) -----------------------------------------------------------------------
//
// Permute(x, perm) -> Transpose(x, perm), where an entry -1 - a (that is ~a) takes input axis a
// reversed (a Transpose after a Slice that flips that axis): x float32, perm int64 [rank], a
// constant. ORT CPU's Transpose copies element by element through a multi-index for every
// permutation that is not a single axis moved over whole rows: 7-12 ns an element on the NCHWc
// filter reorders (``nchwc.py``), where this loop nest takes about one. Axes that stay adjacent
// (in the same direction) merge first; then each block of the last two output axes is a 2-D
// strided gather, spread over the threads.

struct PermutePlan {
  std::vector<size_t> dims;         // merged output axes (at least two)
  std::vector<ptrdiff_t> strides;   // their input strides (negative: reversed)
  size_t start = 0;                 // input offset of output element 0
  size_t rows = 0, block = 0;       // output blocks (all axes but the last two) and their size
};

PermutePlan permute_plan(const std::vector<int64_t>& in_dims, const int64_t* perm, size_t rank) {
  std::vector<ptrdiff_t> in_stride(rank, 1);
  for (size_t i = rank; i-- > 1;) in_stride[i - 1] = in_stride[i] * static_cast<ptrdiff_t>(in_dims[i]);
  PermutePlan plan;
  for (size_t k = 0; k < rank; ++k) {
    const bool reversed = perm[k] < 0;
    const size_t axis = static_cast<size_t>(reversed ? -1 - perm[k] : perm[k]), dim = static_cast<size_t>(in_dims[axis]);
    if (dim == 1) continue;
    const ptrdiff_t stride = reversed ? -in_stride[axis] : in_stride[axis];
    if (reversed) plan.start += (dim - 1) * static_cast<size_t>(in_stride[axis]);
    if (!plan.dims.empty() && plan.strides.back() == stride * static_cast<ptrdiff_t>(dim)) {  // adjacent in both: merge
      plan.dims.back() *= dim;
      plan.strides.back() = stride;
    } else {
      plan.dims.push_back(dim);
      plan.strides.push_back(stride);
    }
  }
  while (plan.dims.size() < 2) plan.dims.insert(plan.dims.begin(), 1), plan.strides.insert(plan.strides.begin(), 0);
  const size_t r = plan.dims.size();
  plan.block = plan.dims[r - 2] * plan.dims[r - 1];
  plan.rows = 1;
  for (size_t k = 0; k + 2 < r; ++k) plan.rows *= plan.dims[k];
  return plan;
}

// Output blocks [b0, b1) of the plan: each the last two output axes, a 2-D strided gather (rows
// copied whole where the last axis is the input's last, forwards).
void permute_blocks(const PermutePlan& plan, const float* __restrict x, float* __restrict y, size_t b0, size_t b1) {
  const size_t outer = plan.dims.size() - 2, n1 = plan.dims[outer], n0 = plan.dims[outer + 1];
  const ptrdiff_t s1 = plan.strides[outer], s0 = plan.strides[outer + 1];
  std::vector<size_t> index(outer, 0);
  size_t rest = b0;
  ptrdiff_t base = static_cast<ptrdiff_t>(plan.start);
  for (size_t k = outer; k-- > 0;) {
    index[k] = rest % plan.dims[k];
    rest /= plan.dims[k];
    base += static_cast<ptrdiff_t>(index[k]) * plan.strides[k];
  }
  for (size_t b = b0; b < b1; ++b) {
    float* out = y + b * plan.block;
    for (size_t i = 0; i < n1; ++i, out += n0) {
      const float* in = x + base + static_cast<ptrdiff_t>(i) * s1;
      if (s0 == 1) {
        std::memcpy(out, in, n0 * sizeof(float));
      } else {
        for (size_t j = 0; j < n0; ++j) out[j] = in[static_cast<ptrdiff_t>(j) * s0];
      }
    }
    for (size_t k = outer; k-- > 0;) {  // the next block's multi-index and offset
      base += plan.strides[k];
      if (++index[k] < plan.dims[k]) break;
      base -= static_cast<ptrdiff_t>(index[k]) * plan.strides[k];
      index[k] = 0;
    }
  }
}

OrtStatus* permute_compute(void*, OrtKernelContext* ctx) {
  Tensor x, perm_t;
  if (OrtStatus* st = input(ctx, 0, &x)) return st;
  if (OrtStatus* st = input(ctx, 1, &perm_t)) return st;
  const size_t rank = x.dims.size();
  const int64_t* perm = reinterpret_cast<const int64_t*>(perm_t.data);
  if (x.type != MPG_FLOAT || perm_t.count != rank) return status("Permute: x must be float32 and perm one entry per axis");
  std::vector<int64_t> out_dims(rank);
  std::vector<bool> seen(rank, false);
  for (size_t k = 0; k < rank; ++k) {
    const int64_t axis = perm[k] < 0 ? -1 - perm[k] : perm[k];
    if (axis >= static_cast<int64_t>(rank) || seen[static_cast<size_t>(axis)])
      return status("Permute: perm is not a permutation of x's axes");
    seen[static_cast<size_t>(axis)] = true;
    out_dims[k] = x.dims[static_cast<size_t>(axis)];
  }
  Tensor y;
  if (OrtStatus* st = output(ctx, 0, out_dims, &y)) return st;
  if (x.count == 0) return nullptr;
  const PermutePlan plan = permute_plan(x.dims, perm, rank);
  const size_t per = std::max<size_t>(1, kCpuChunk / std::max<size_t>(plan.block, 1));
  return parallel_for(ctx, (plan.rows + per - 1) / per, [&](size_t b) {
    permute_blocks(plan, x.data, y.data, b * per, std::min(plan.rows, (b + 1) * per));
  });
}

// -- SdpaForward / SdpaBackward (CUDA in sdpa.cu through cuDNN; the interface in sdpa.h) -----
//
// SdpaForward(Q, K, V) -> (Y, Stats): Y = softmax(scale * Q K^T, causally masked) V, without
//     the [Sq, Skv] scores leaving the kernel; Stats float32 [B, Hq, Sq, 1], per query row the
//     natural-log log-sum-exp of its scaled, masked scores.
// SdpaBackward(Q, K, V, Y, dY, Stats) -> (dQ, dK, dV): with P = exp(scale * Q K^T - Stats)
//     recomputed and D_i = rowsum(dY * Y): dV = P^T dY, dS = P * (dY V^T - D), dQ = scale dS K,
//     dK = scale dS^T Q; GQA sums dK and dV over the query heads of a group.
// Attributes: scale (float; absent: 1/sqrt(head_dim)), is_causal (top-left: query i sees keys
// j <= i), q_num_heads and kv_num_heads (3-D inputs). Layouts: 4-D [B, H, S, D] or 3-D
// [B, S, H * D] (ONNX Attention's); Hq a multiple of Hkv, query head h reads kv head
// h / (Hq / Hkv). CPU: float32, plain loops in float32 over (batch, head) tasks (a reference
// for the CUDA path and for tests, not for speed). CUDA: float16 and bfloat16, only in a build
// with cuDNN (MPG_WITH_CUDNN).

#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUDNN)
#define MPG_SDPA_CUDA(...) __VA_ARGS__
#define MPG_SDPA_ERROR() std::string(mpg_sdpa_last_error())
#else
#define MPG_SDPA_CUDA(...) ((void)stream, 0)
#define MPG_SDPA_ERROR() std::string()
#endif

// Strides of dims (batch, head, sequence, head dim) of a contiguous tensor of ``heads`` heads
// of ``dim`` elements: 4-D [B, H, S, D] or 3-D [B, S, H * D].
void sdpa_strides(bool four_d, int64_t heads, int64_t len, int64_t dim, int64_t* stride) {
  stride[3] = 1;
  if (four_d) {
    stride[2] = dim, stride[1] = len * dim, stride[0] = heads * len * dim;
  } else {
    stride[1] = dim, stride[2] = heads * dim, stride[0] = len * heads * dim;
  }
}

// The shape of an SDPA from Q, K and V (their dims checked against each other), and Y's dims.
OrtStatus* sdpa_shape(const char* name, const Kernel& kernel, const Tensor& q, const Tensor& k, const Tensor& v,
                      SdpaShape* s, std::vector<int64_t>* y_dims) {
  const size_t rank = q.dims.size();
  if ((rank != 3 && rank != 4) || k.dims.size() != rank || v.dims.size() != rank)
    return status(std::string(name) + ": Q, K and V must all be 3-D [B, S, H*D] or all 4-D [B, H, S, D]");
  std::memset(s, 0, sizeof(*s));
  const bool four = rank == 4;
  s->batch = q.dims[0];
  s->q_heads = four ? q.dims[1] : kernel.q_heads;
  s->kv_heads = four ? k.dims[1] : kernel.kv_heads;
  if (s->q_heads <= 0 || s->kv_heads <= 0 || s->q_heads % s->kv_heads)
    return status(std::string(name) + ": the head counts must be positive, q heads a multiple of kv heads (3-D "
                  "inputs need q_num_heads and kv_num_heads)");
  const int64_t seq = four ? 2 : 1;
  s->q_len = q.dims[seq];
  s->kv_len = k.dims[seq];
  s->head_dim = four ? q.dims[3] : q.dims[2] / s->q_heads;
  s->v_head_dim = four ? v.dims[3] : v.dims[2] / s->kv_heads;
  const bool fits = four ? (k.dims[1] == v.dims[1] && k.dims[3] == s->head_dim)
                         : (q.dims[2] == s->q_heads * s->head_dim && k.dims[2] == s->kv_heads * s->head_dim &&
                            v.dims[2] == s->kv_heads * s->v_head_dim);
  if (!fits || k.dims[0] != s->batch || v.dims[0] != s->batch || v.dims[seq] != s->kv_len)
    return status(std::string(name) + ": Q, K and V disagree in batch, heads, length or head dim");
  sdpa_strides(four, s->q_heads, s->q_len, s->head_dim, s->q_stride);
  sdpa_strides(four, s->kv_heads, s->kv_len, s->head_dim, s->k_stride);
  sdpa_strides(four, s->kv_heads, s->kv_len, s->v_head_dim, s->v_stride);
  sdpa_strides(four, s->q_heads, s->q_len, s->v_head_dim, s->y_stride);
  s->type = q.type;
  s->causal = kernel.causal ? 1 : 0;
  s->scale = kernel.has_scale ? kernel.scale : 1.0f / std::sqrt(static_cast<float>(s->head_dim));
  if (four)
    *y_dims = {s->batch, s->q_heads, s->q_len, s->v_head_dim};
  else
    *y_dims = {s->batch, s->q_len, s->q_heads * s->v_head_dim};
  return nullptr;
}

// Keys query i sees.
int64_t sdpa_keys(const SdpaShape& s, int64_t i) { return s.causal ? std::min(i + 1, s.kv_len) : s.kv_len; }

// Row i of head (b, h)'s scaled scores into p[0, keys); the row's max.
float sdpa_scores(const SdpaShape& s, const float* q, const float* k, int64_t i, int64_t keys, float* p) {
  float max = -INFINITY;
  for (int64_t j = 0; j < keys; ++j) {
    float dot = 0.0f;
    for (int64_t d = 0; d < s.head_dim; ++d) dot += q[i * s.q_stride[2] + d] * k[j * s.k_stride[2] + d];
    p[j] = dot * s.scale;
    max = std::max(max, p[j]);
  }
  return max;
}

// One (batch, query head) of the forward: q, k, v, y point at the head's first element.
void sdpa_forward_head(const SdpaShape& s, const float* q, const float* k, const float* v, float* y, float* stats) {
  std::vector<float> p(static_cast<size_t>(s.kv_len));
  for (int64_t i = 0; i < s.q_len; ++i) {
    const int64_t keys = sdpa_keys(s, i);
    const float max = sdpa_scores(s, q, k, i, keys, p.data());
    float sum = 0.0f;
    for (int64_t j = 0; j < keys; ++j) sum += (p[j] = std::exp(p[j] - max));
    for (int64_t j = 0; j < keys; ++j) p[j] /= sum;
    for (int64_t d = 0; d < s.v_head_dim; ++d) {
      float acc = 0.0f;
      for (int64_t j = 0; j < keys; ++j) acc += p[j] * v[j * s.v_stride[2] + d];
      y[i * s.y_stride[2] + d] = keys ? acc : 0.0f;
    }
    stats[i] = keys ? max + std::log(sum) : -INFINITY;
  }
}

// One (batch, kv head) of the backward: the query heads of its group, one after the other, so
// dK and dV (this task's alone) sum over them in order. t[]: q, k, v, y, dy, dq, dk, dv at head
// (b, 0) of each (q, y, dy, dq) or at (b, g) (k, v, dk, dv).
void sdpa_backward_group(const SdpaShape& s, const float* const* t, float* const* out, const float* stats) {
  const float *q0 = t[0], *k = t[1], *v = t[2], *y0 = t[3], *dy0 = t[4];
  float *dq0 = out[0], *dk = out[1], *dv = out[2];
  for (int64_t j = 0; j < s.kv_len; ++j) {
    for (int64_t d = 0; d < s.head_dim; ++d) dk[j * s.k_stride[2] + d] = 0.0f;
    for (int64_t d = 0; d < s.v_head_dim; ++d) dv[j * s.v_stride[2] + d] = 0.0f;
  }
  std::vector<float> p(static_cast<size_t>(s.kv_len)), ds(static_cast<size_t>(s.kv_len));
  for (int64_t r = 0; r < s.q_heads / s.kv_heads; ++r) {
    const float *q = q0 + r * s.q_stride[1], *y = y0 + r * s.y_stride[1], *dy = dy0 + r * s.y_stride[1];
    float* dq = dq0 + r * s.q_stride[1];
    const float* lse = stats + r * s.q_len;
    for (int64_t i = 0; i < s.q_len; ++i) {
      const int64_t keys = sdpa_keys(s, i);
      const float *yi = y + i * s.y_stride[2], *dyi = dy + i * s.y_stride[2], *qi = q + i * s.q_stride[2];
      float delta = 0.0f;
      for (int64_t d = 0; d < s.v_head_dim; ++d) delta += dyi[d] * yi[d];
      sdpa_scores(s, q, k, i, keys, p.data());
      for (int64_t j = 0; j < keys; ++j) {
        p[j] = std::exp(p[j] - lse[i]);
        const float* vj = v + j * s.v_stride[2];
        float dp = 0.0f;
        for (int64_t d = 0; d < s.v_head_dim; ++d) dp += dyi[d] * vj[d];
        ds[j] = (p[j] * (dp - delta)) * s.scale;
        float* dvj = dv + j * s.v_stride[2];
        for (int64_t d = 0; d < s.v_head_dim; ++d) dvj[d] += p[j] * dyi[d];
      }
      for (int64_t d = 0; d < s.head_dim; ++d) {
        float acc = 0.0f;
        for (int64_t j = 0; j < keys; ++j) acc += ds[j] * k[j * s.k_stride[2] + d];
        dq[i * s.q_stride[2] + d] = acc;
      }
      for (int64_t j = 0; j < keys; ++j)
        for (int64_t d = 0; d < s.head_dim; ++d) dk[j * s.k_stride[2] + d] += ds[j] * qi[d];
    }
  }
}

// ``launch(stream)`` on the session's CUDA stream; a nonzero return is an error status with
// sdpa.cu's message.
template <typename Launch>
OrtStatus* sdpa_on_gpu(OrtKernelContext* ctx, const std::string& name, Launch launch) {
  return on_gpu_or(ctx, name, launch, [] { return MPG_SDPA_ERROR(); });
}

// Q, K, V (and, for the backward, Y and dY) read and checked; Stats' dims.
OrtStatus* sdpa_inputs(OrtKernelContext* ctx, const Kernel& kernel, const char* name, size_t count, Tensor* t,
                       SdpaShape* s, std::vector<int64_t>* y_dims) {
  for (size_t i = 0; i < count; ++i) {
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
    if (t[i].type != t[0].type) return status(std::string(name) + ": Q, K, V, Y and dY differ in type");
  }
  if (!kernel.cuda && t[0].type != MPG_FLOAT) return status(std::string(name) + ": the CPU kernel is float32 only");
  if (OrtStatus* st = sdpa_shape(name, kernel, t[0], t[1], t[2], s, y_dims)) return st;
  for (size_t i = 3; i < count; ++i)
    if (t[i].dims != *y_dims) return status(std::string(name) + ": Y or dY has not the shape of the output");
  return nullptr;
}

OrtStatus* sdpa_forward_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor t[3], y, stats;
  SdpaShape s;
  std::vector<int64_t> y_dims;
  if (OrtStatus* st = sdpa_inputs(ctx, kernel, "SdpaForward", 3, t, &s, &y_dims)) return st;
  if (OrtStatus* st = output(ctx, 0, y_dims, &y)) return st;
  if (OrtStatus* st = output(ctx, 1, {s.batch, s.q_heads, s.q_len, 1}, &stats)) return st;
  if (y.count == 0) return nullptr;
  if (!kernel.cuda) {
    return parallel_for(ctx, static_cast<size_t>(s.batch * s.q_heads), [&](size_t task) {
      const int64_t b = static_cast<int64_t>(task) / s.q_heads, h = static_cast<int64_t>(task) % s.q_heads;
      const int64_t g = h / (s.q_heads / s.kv_heads);
      sdpa_forward_head(s, t[0].data + b * s.q_stride[0] + h * s.q_stride[1], t[1].data + b * s.k_stride[0] + g * s.k_stride[1],
                        t[2].data + b * s.v_stride[0] + g * s.v_stride[1], y.data + b * s.y_stride[0] + h * s.y_stride[1],
                        stats.data + static_cast<int64_t>(task) * s.q_len);
    });
  }
  return sdpa_on_gpu(ctx, "SdpaForward", [&](void* stream) {
    return MPG_SDPA_CUDA(mpg_sdpa_forward_cuda(&s, t[0].data, t[1].data, t[2].data, y.data, stats.data, stream));
  });
}

OrtStatus* sdpa_backward_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor t[5], stats, d[3];
  SdpaShape s;
  std::vector<int64_t> y_dims;
  if (OrtStatus* st = sdpa_inputs(ctx, kernel, "SdpaBackward", 5, t, &s, &y_dims)) return st;
  if (OrtStatus* st = input(ctx, 5, &stats)) return st;
  if (stats.type != MPG_FLOAT || stats.count != static_cast<size_t>(s.batch * s.q_heads * s.q_len))
    return status("SdpaBackward: Stats must be float32 [B, Hq, Sq, 1]");
  for (size_t i = 0; i < 3; ++i)
    if (OrtStatus* st = output(ctx, i, t[i].dims, &d[i])) return st;
  if (d[0].count + d[1].count + d[2].count == 0) return nullptr;
  if (!kernel.cuda) {
    const int64_t reps = s.q_heads / s.kv_heads;
    return parallel_for(ctx, static_cast<size_t>(s.batch * s.kv_heads), [&](size_t task) {
      const int64_t b = static_cast<int64_t>(task) / s.kv_heads, g = static_cast<int64_t>(task) % s.kv_heads;
      const int64_t qo = b * s.q_stride[0] + g * reps * s.q_stride[1], yo = b * s.y_stride[0] + g * reps * s.y_stride[1];
      const int64_t ko = b * s.k_stride[0] + g * s.k_stride[1], vo = b * s.v_stride[0] + g * s.v_stride[1];
      const float* in[5] = {t[0].data + qo, t[1].data + ko, t[2].data + vo, t[3].data + yo, t[4].data + yo};
      float* out[3] = {d[0].data + qo, d[1].data + ko, d[2].data + vo};
      sdpa_backward_group(s, in, out, stats.data + (b * s.q_heads + g * reps) * s.q_len);
    });
  }
  return sdpa_on_gpu(ctx, "SdpaBackward", [&](void* stream) {
    return MPG_SDPA_CUDA(mpg_sdpa_backward_cuda(&s, t[0].data, t[1].data, t[2].data, t[3].data, t[4].data, stats.data,
                                                d[0].data, d[1].data, d[2].data, stream));
  });
}

// -- Pointwise (pointwise.h; CUDA in pointwise.cu) --------------------------------------------
//
// Pointwise(x_1, ...) -> (y_1, ...): a group of elementwise ONNX ops run as one register program
// (mpgraph/lowering/pointwise.py). Attributes: program, "op dst a b t" instructions separated by
// ";" (op: cvt add sub mul div neg abs sqrt rcp; b -1 for one operand; t the ONNX dtype the op
// rounds to), and outputs, "reg:d0,d1,..." per output. Inputs and outputs float32, float16 or
// bfloat16 each; every output has n elements, an input n, one, or the last dim's count.

#ifdef MPG_WITH_CUDA
extern "C" int mpg_pointwise_cuda(const PwProgram* program, const PwArgs* args, void* stream);
#endif

struct PwCpuRound {
  static float bf16(float v) {
    const uint32_t bits = static_cast<uint32_t>(float_to_bfloat16(v)) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
  }
  static float f16(float v) { return half_to_float(float_to_float16(v)); }
  static float sqrt(float v) { return std::sqrt(v); }
};

std::shared_ptr<PointwisePlan> pointwise_parse(const std::string& program, const std::string& outputs) {
  auto plan = std::make_shared<PointwisePlan>();
  static const char* const kNames[] = {"cvt", "add", "sub", "mul", "div", "neg", "abs", "sqrt", "rcp"};
  std::stringstream code(program);
  std::string item;
  while (std::getline(code, item, ';')) {
    std::istringstream fields(item);
    std::string op;
    int dst = -1, a = -1, b = -1, t = 0;
    fields >> op >> dst >> a >> b >> t;
    int found = -1;
    for (int k = 0; k < 9; ++k) found = op == kNames[k] ? k : found;
    if (!fields || found < 0 || dst < 0 || dst >= kPwMaxRegisters || a < 0 || a >= kPwMaxRegisters ||
        b >= kPwMaxRegisters || (t != 1 && t != 10 && t != 16) || plan->program.count == kPwMaxProgram) {
      plan->error = "bad instruction '" + item + "' (or more than 32)";
      return plan;
    }
    plan->program.code[plan->program.count++] = {static_cast<uint8_t>(found), static_cast<uint8_t>(dst),
                                                 static_cast<uint8_t>(a), static_cast<uint8_t>(b < 0 ? 255 : b),
                                                 static_cast<uint8_t>(t)};
  }
  std::istringstream outs(outputs);
  while (outs >> item) {
    const size_t colon = item.find(':');
    const int reg = colon == std::string::npos ? -1 : std::atoi(item.substr(0, colon).c_str());
    if (reg < 0 || reg >= kPwMaxRegisters || plan->out_reg.size() == kPwMaxOutputs) {
      plan->error = "bad output '" + item + "'";
      return plan;
    }
    std::vector<int64_t> dims;
    std::stringstream ds(item.substr(colon + 1));
    std::string d;
    while (std::getline(ds, d, ',')) dims.push_back(std::atoll(d.c_str()));
    plan->out_reg.push_back(reg);
    plan->out_dims.push_back(dims);
  }
  if (plan->out_reg.empty()) plan->error = "no outputs";
  return plan;
}

void pointwise_cpu(const PwProgram& program, const PwArgs& args, size_t a, size_t b) {
  float r[kPwMaxRegisters] = {};
  for (size_t i = a; i < b; ++i) {
    for (int k = 0; k < args.inputs; ++k)
      r[k] = load_cpu(args.in[k], args.in_type[k], static_cast<size_t>(pw_index(args.in_mode[k], i, args.last)));
    pw_exec<PwCpuRound>(program, r);
    for (int k = 0; k < args.outputs; ++k) {
      const float v = r[args.out_reg[k]];
      if (args.out_type[k] == MPG_BFLOAT16)
        static_cast<uint16_t*>(args.out[k])[i] = float_to_bfloat16(v);
      else if (args.out_type[k] == MPG_FLOAT16)
        static_cast<uint16_t*>(args.out[k])[i] = float_to_float16(v);
      else
        static_cast<float*>(args.out[k])[i] = v;
    }
  }
}

bool pw_float_type(int type) { return type == MPG_FLOAT || type == MPG_FLOAT16 || type == MPG_BFLOAT16; }

OrtStatus* pointwise_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  const PointwisePlan& plan = *kernel.pw;
  if (!plan.error.empty()) return status("Pointwise: " + plan.error);
  PwArgs args;
  args.inputs = static_cast<int>(input_count(ctx));
  args.outputs = static_cast<int>(plan.out_reg.size());
  if (args.inputs > kPwMaxInputs) return status("Pointwise: more than 12 inputs");
  args.n = 1;
  for (int64_t d : plan.out_dims[0]) args.n *= d;
  args.last = plan.out_dims[0].empty() ? 1 : std::max<int64_t>(plan.out_dims[0].back(), 1);
  for (int k = 0; k < args.inputs; ++k) {
    Tensor t;
    if (OrtStatus* st = input(ctx, static_cast<size_t>(k), &t)) return st;
    const int64_t count = static_cast<int64_t>(t.count);
    args.in_mode[k] = count == args.n ? kPwFull : count == 1 ? kPwScalar : count == args.last ? kPwRow : -1;
    if (!pw_float_type(t.type) || args.in_mode[k] < 0 || plan.out_reg.size() > kPwMaxOutputs)
      return status("Pointwise: input " + std::to_string(k) + " is not float32/float16/bfloat16 of the outputs' "
                    "size, one element or the last dim's");
    args.in[k] = t.data;
    args.in_type[k] = t.type;
  }
  for (int k = 0; k < args.outputs; ++k) {
    Tensor o;
    if (OrtStatus* st = output(ctx, static_cast<size_t>(k), plan.out_dims[k], &o)) return st;
    if (!pw_float_type(o.type) || static_cast<int64_t>(o.count) != args.n || plan.out_reg[k] >= kPwMaxRegisters)
      return status("Pointwise: output " + std::to_string(k) + " differs in size or type from the first");
    args.out[k] = o.data;
    args.out_type[k] = o.type;
    args.out_reg[k] = plan.out_reg[k];
  }
  if (args.n == 0) return nullptr;
  args.vector = 1;
  for (int k = 0; k < args.inputs; ++k)
    if (args.in_mode[k] == kPwFull && reinterpret_cast<uintptr_t>(args.in[k]) % 16) args.vector = 0;
  for (int k = 0; k < args.outputs; ++k)
    if (reinterpret_cast<uintptr_t>(args.out[k]) % 16) args.vector = 0;
  if (!kernel.cuda) {
    return parallel_chunks(ctx, static_cast<size_t>(args.n), [&](size_t a, size_t b) {
      pointwise_cpu(plan.program, args, a, b);
    });
  }
  return on_gpu(ctx, "Pointwise", [&](void* stream) { return MPG_CUDA(mpg_pointwise_cuda(&plan.program, &args, stream)); });
}

// -- GemmBias (gemm_bias.h; CUDA in gemm_bias.cu through cuBLASLt) ---------------------------
//
// GemmBias(A, B, bias) -> Y: Y = alpha * A' B' + bias (2-D B, bias [N] or [1, ..., 1, N]; A' and
// B' as gemm_bias.h says). A is 2-D, or, without transA, [..., K] (a MatMul's: its rows are the
// product of its leading dims, and Y is [..., N]). Attributes transA, transB (0/1) and alpha
// (absent: 1). Float16 or
// bfloat16: the products accumulate in float32, the bias is added in float32, and the sum is
// rounded once.
// GemmBiasGelu(A, B, bias) -> (Y, Pre): the same sum v; Y = gelu_tanh(v) rounded once, Pre = v
// rounded (the GELU's input, which its backward reads), both [M, N] (cuBLASLt's GELU_AUX_BIAS). CPU: a reference loop (for the rule's tests, not for speed). CUDA: one cuBLASLt
// matmul with the bias epilogue, only in a build with cuBLASLt (MPG_WITH_CUBLASLT).

#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUBLASLT)
#define MPG_GEMM_BIAS_CUDA(...) __VA_ARGS__
#define MPG_GEMM_BIAS_ERROR() std::string(mpg_gemm_bias_last_error())
#else
#define MPG_GEMM_BIAS_CUDA(...) ((void)stream, 0)
#define MPG_GEMM_BIAS_ERROR() std::string()
#endif

uint16_t gemm_bias_round(float v, int type) { return type == MPG_BFLOAT16 ? float_to_bfloat16(v) : float_to_float16(v); }

// Rows [r0, r1) of Y (and of pre, when not null: then Y is the tanh GELU of the float32 sum):
// each row's N sums accumulate over k in order, in float32.
void gemm_bias_rows(const GemmBiasShape& s, const Tensor& a, const std::vector<float>& b, const Tensor& bias, void* y,
                    void* pre, int64_t r0, int64_t r1) {
  std::vector<float> acc(static_cast<size_t>(s.n));
  for (int64_t i = r0; i < r1; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t kk = 0; kk < s.k; ++kk) {
      const float av = load_cpu(a.data, a.type, static_cast<size_t>(s.trans_a ? kk * s.m + i : i * s.k + kk));
      const float* bk = b.data() + kk * s.n;
      for (int64_t j = 0; j < s.n; ++j) acc[j] += av * bk[j];
    }
    uint16_t* out = static_cast<uint16_t*>(y) + i * s.n;
    uint16_t* pre_out = pre ? static_cast<uint16_t*>(pre) + i * s.n : nullptr;
    for (int64_t j = 0; j < s.n; ++j) {
      const float v = acc[j] * s.alpha + load_cpu(bias.data, bias.type, static_cast<size_t>(j));
      if (!pre_out) {
        out[j] = gemm_bias_round(v, s.type);
        continue;
      }
      pre_out[j] = gemm_bias_round(v, s.type);
      out[j] = gemm_bias_round(0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v))), s.type);
    }
  }
}

OrtStatus* gemm_bias_run(void* kernel_ptr, OrtKernelContext* ctx, bool gelu) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor t[3], y, pre;
  for (size_t i = 0; i < 3; ++i) {
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
    if (t[i].type != t[0].type || (t[i].type != MPG_FLOAT16 && t[i].type != MPG_BFLOAT16))
      return status("GemmBias: A, B and bias must all be float16 or all bfloat16");
  }
  GemmBiasShape s{};
  s.trans_a = kernel.gemm_trans_a ? 1 : 0, s.trans_b = kernel.gemm_trans_b ? 1 : 0;
  if (t[0].dims.size() < 2 || (s.trans_a && t[0].dims.size() != 2) || t[1].dims.size() != 2)
    return status("GemmBias: B must be 2-D, A 2-D or (without transA) [..., K]");
  s.k = t[0].dims[s.trans_a ? 0 : t[0].dims.size() - 1];
  s.m = s.trans_a ? t[0].dims[1] : (s.k ? static_cast<int64_t>(t[0].count) / s.k : 0);
  s.n = t[1].dims[s.trans_b ? 0 : 1];
  s.alpha = kernel.gemm_alpha, s.type = t[0].type;
  bool row = !t[2].dims.empty() && t[2].dims.back() == s.n;
  for (size_t d = 0; d + 1 < t[2].dims.size(); ++d) row = row && t[2].dims[d] == 1;
  if (t[1].dims[s.trans_b ? 1 : 0] != s.k || !row)
    return status("GemmBias: A' is [M, K], B' must be [K, N] and bias [N] or [1, ..., 1, N]");
  std::vector<int64_t> y_dims{s.m, s.n};
  if (!s.trans_a) {
    y_dims.assign(t[0].dims.begin(), t[0].dims.end());
    y_dims.back() = s.n;
  }
  if (OrtStatus* st = output(ctx, 0, y_dims, &y)) return st;
  if (gelu)
    if (OrtStatus* st = output(ctx, 1, y_dims, &pre)) return st;
  if (y.count == 0) return nullptr;
  if (!kernel.cuda) {
    std::vector<float> b(static_cast<size_t>(s.k * s.n));  // B' as float32 [K, N]
    for (int64_t kk = 0; kk < s.k; ++kk)
      for (int64_t j = 0; j < s.n; ++j)
        b[kk * s.n + j] = load_cpu(t[1].data, t[1].type, static_cast<size_t>(s.trans_b ? j * s.k + kk : kk * s.n + j));
    const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(kCpuChunk) / std::max<int64_t>(s.n * std::max<int64_t>(s.k, 1), 1));
    return parallel_for(ctx, static_cast<size_t>((s.m + per - 1) / per), [&](size_t task) {
      const int64_t r0 = static_cast<int64_t>(task) * per;
      gemm_bias_rows(s, t[0], b, t[2], y.data, gelu ? pre.data : nullptr, r0, std::min(s.m, r0 + per));
    });
  }
  return on_gpu_or(ctx, gelu ? "GemmBiasGelu" : "GemmBias", [&](void* stream) {
    return MPG_GEMM_BIAS_CUDA(mpg_gemm_bias_cuda(&s, t[0].data, t[1].data, t[2].data, y.data, gelu ? pre.data : nullptr, stream));
  }, [] { return MPG_GEMM_BIAS_ERROR(); });
}

OrtStatus* gemm_bias_compute(void* k, OrtKernelContext* c) { return gemm_bias_run(k, c, false); }
OrtStatus* gemm_bias_gelu_compute(void* k, OrtKernelContext* c) { return gemm_bias_run(k, c, true); }

// -- GemmFp8 (gemm_fp8.h; CUDA in gemm_fp8.cu through cuBLASLt) -----------------------------
//
// GemmFp8(A, B, scaleA, scaleB[, Bias]) -> Y: Y [M, N] = alpha * scaleA * scaleB * A B^T (+ Bias),
// A [M, K] and B [N, K] float8e4m3fn or float8e5m2 (not both e5m2), the scales float32 scalars,
// Bias bfloat16 [N] added to every row before the one rounding, Y bfloat16 (fp8_gemm.py writes it
// for ORT's GemmFloat8 where the library has cuBLASLt; rule 8 gives it a bias). Attribute alpha
// (absent: 1). CPU: a reference loop (the fp8 values decoded exactly, float32 sums, one
// rounding); CUDA: one cuBLASLt fp8 matmul (its bias epilogue), only in a build with cuBLASLt
// (MPG_WITH_CUBLASLT).

#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUBLASLT)
#define MPG_GEMM_FP8_CUDA(...) __VA_ARGS__
#define MPG_GEMM_FP8_ERROR() std::string(mpg_gemm_fp8_last_error())
#else
#define MPG_GEMM_FP8_CUDA(...) ((void)stream, 0)
#define MPG_GEMM_FP8_ERROR() std::string()
#endif

enum { MPG_FLOAT8E4M3FN = 17, MPG_FLOAT8E5M2 = 19 };

// on_gpu for the fp8 ops, with gemm_fp8.cu's message.
template <typename Launch>
OrtStatus* fp8_on_gpu(OrtKernelContext* ctx, const std::string& name, Launch launch) {
  return on_gpu_or(ctx, name, launch, [] { return MPG_GEMM_FP8_ERROR(); });
}

// One fp8 byte as float32 (exact): e4m3fn (bias 7, no infinities, S.1111.111 NaN) or e5m2 (bias
// 15, the top byte of a float16).
float fp8_to_float(uint8_t v, int type) {
  const bool e5 = type == MPG_FLOAT8E5M2;
  const int mbits = e5 ? 2 : 3, bias = e5 ? 15 : 7;
  const int exp = (v & 0x7f) >> mbits, man = v & ((1 << mbits) - 1);
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  if (e5 && exp == 31) return man ? NAN : sign * INFINITY;
  if (!e5 && exp == 15 && man == 7) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), 1 - bias - mbits);
  return sign * std::ldexp(static_cast<float>(man + (1 << mbits)), exp - bias - mbits);
}

OrtStatus* gemm_fp8_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor t[4], y;
  for (size_t i = 0; i < 4; ++i)
    if (OrtStatus* st = input(ctx, i, &t[i])) return st;
  for (size_t i = 0; i < 2; ++i)
    if (t[i].type != MPG_FLOAT8E4M3FN && t[i].type != MPG_FLOAT8E5M2) return status("GemmFp8: A and B must be float8e4m3fn or float8e5m2");
  if (t[0].type == MPG_FLOAT8E5M2 && t[1].type == MPG_FLOAT8E5M2) return status("GemmFp8: A and B cannot both be float8e5m2");
  // A [..., K]: its leading dims are M (a 3-D activation read as it is, no reshaped copy).
  if (t[0].dims.size() < 2 || t[1].dims.size() != 2 || t[0].dims.back() != t[1].dims[1])
    return status("GemmFp8: A must be [..., K] and B [N, K]");
  if (t[2].type != MPG_FLOAT || t[3].type != MPG_FLOAT || t[2].count != 1 || t[3].count != 1)
    return status("GemmFp8: scaleA and scaleB must be one float32 each");
  const int64_t k = t[1].dims[1], m = k ? static_cast<int64_t>(t[0].count) / k : 0;
  // Bias (optional): bfloat16 [N], added to the float32 result before its one rounding.
  Tensor bias;
  bool has_bias = false;
  if (OrtStatus* st = optional_input(ctx, 4, &bias, &has_bias)) return st;
  if (has_bias && (bias.type != MPG_BFLOAT16 || bias.dims.size() != 1 || bias.dims[0] != t[1].dims[0]))
    return status("GemmFp8: Bias must be bfloat16 [N]");
  GemmFp8Shape s{m, t[1].dims[0], k, kernel.gemm_alpha, t[0].type, t[1].type, has_bias};
  if (OrtStatus* st = output(ctx, 0, {s.m, s.n}, &y)) return st;
  if (y.count == 0) return nullptr;
  if (!kernel.cuda) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>(t[0].data);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(t[1].data);
    const float scale = s.alpha * t[2].data[0] * t[3].data[0];
    std::vector<float> bf(static_cast<size_t>(s.n * s.k));
    for (size_t i = 0; i < bf.size(); ++i) bf[i] = fp8_to_float(b[i], s.type_b);
    const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(kCpuChunk) / std::max<int64_t>(s.n * std::max<int64_t>(s.k, 1), 1));
    return parallel_for(ctx, static_cast<size_t>((s.m + per - 1) / per), [&](size_t task) {
      std::vector<float> row(static_cast<size_t>(s.k));
      uint16_t* out = static_cast<uint16_t*>(static_cast<void*>(y.data));
      for (int64_t i = static_cast<int64_t>(task) * per; i < std::min(s.m, static_cast<int64_t>(task + 1) * per); ++i) {
        for (int64_t kk = 0; kk < s.k; ++kk) row[kk] = fp8_to_float(a[i * s.k + kk], s.type_a);
        for (int64_t j = 0; j < s.n; ++j) {
          float acc = 0.0f;
          for (int64_t kk = 0; kk < s.k; ++kk) acc += row[kk] * bf[j * s.k + kk];
          const float v = acc * scale;
          out[i * s.n + j] = float_to_bfloat16(has_bias ? v + load_cpu(bias.data, MPG_BFLOAT16, static_cast<size_t>(j)) : v);
        }
      }
    });
  }
  return fp8_on_gpu(ctx, "GemmFp8", [&](void* stream) {
    return MPG_GEMM_FP8_CUDA(mpg_gemm_fp8_cuda(&s, t[0].data, t[1].data, t[2].data, t[3].data, has_bias ? bias.data : nullptr, y.data, stream));
  });
}

// Fp8Transpose(X) -> Y: X's leading dims flattened into rows, Y [cols, rows] = X [rows, cols]^T,
// one-byte elements (float8e4m3fn or float8e5m2) moved as they are; the transposed GemmFp8
// operands cut from fp8 values the step has (fp8_gemm.py rule 6). CUDA with cuBLASLt builds only,
// as GemmFp8.
OrtStatus* fp8_transpose_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor x, y;
  if (OrtStatus* st = input(ctx, 0, &x)) return st;
  if (x.type != MPG_FLOAT8E4M3FN && x.type != MPG_FLOAT8E5M2) return status("Fp8Transpose: X must be float8e4m3fn or float8e5m2");
  if (x.dims.size() < 2) return status("Fp8Transpose: X must have two dims or more");
  const int64_t cols = x.dims.back(), rows = cols ? static_cast<int64_t>(x.count) / cols : 0;
  if (OrtStatus* st = output(ctx, 0, {cols, rows}, &y)) return st;
  if (y.count == 0) return nullptr;
  const uint8_t* in = reinterpret_cast<const uint8_t*>(x.data);
  uint8_t* out = reinterpret_cast<uint8_t*>(y.data);
  if (!kernel.cuda) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
    return nullptr;
  }
  return fp8_on_gpu(ctx, "Fp8Transpose", [&](void* stream) {
    return MPG_GEMM_FP8_CUDA(mpg_transpose_bytes_cuda(in, out, rows, cols, stream));
  });
}

// |v| as the bits of a non-negative float32: larger values have larger bits, a NaN above infinity
// (the order AbsMax's maximum is taken in).
uint32_t magnitude_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffffu;
}

// float32 -> fp8 (e4m3fn: 3 mantissa bits, bias 7, max 448; e5m2: 2, 15, 57344) rounded to nearest
// even with saturation, as ONNX's Cast(saturate=1): beyond the largest finite value (infinities
// too) the largest finite value, NaN a NaN (0x7f with its sign).
uint8_t float_to_fp8(float f, int type) {
  const bool e5 = type == MPG_FLOAT8E5M2;
  const int mbits = e5 ? 2 : 3, bias = e5 ? 15 : 7;
  const float top = e5 ? 57344.0f : 448.0f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7f;
  const float a = std::fabs(f);
  if (a >= top) return sign | (e5 ? 0x7b : 0x7e);
  const float tiny = std::ldexp(1.0f, 1 - bias);  // the smallest normal
  if (a < tiny)  // subnormal steps of 2^(1 - bias - mbits); 2^mbits of them is the smallest normal's code
    return sign | static_cast<uint8_t>(std::nearbyint(a / std::ldexp(1.0f, 1 - bias - mbits)));
  int ex = 0;
  const float fr = std::frexp(a, &ex);  // a = fr 2^ex, fr in [0.5, 1)
  int e = ex - 1;
  int q = static_cast<int>(std::nearbyint((fr * 2.0f - 1.0f) * static_cast<float>(1 << mbits)));
  if (q == 1 << mbits) q = 0, ++e;
  return sign | static_cast<uint8_t>(((e + bias) << mbits) | q);
}

// CastToFloat8E4M3FN(X, scale) -> Q, CastToFloat8E5M2(X, scale) -> Q: Q = Cast(X * scale, fp8,
// saturate=1) with X float32, float16 or bfloat16 (widened exactly) and scale a float32 scalar;
// the product rounds to float32 first, as the Mul it replaces did. One read of X and one byte
// written an element, where the quantisation chain wrote a float32 X * scale and read it again
// (fp8_gemm.py rule 6). CastToFloat8E4M3FNAmax and CastToFloat8E5M2Amax also write Amax, X's
// AbsMax, in the same read (a delayed-scaling amax whose scale comes from earlier steps; rule 7).
// CUDA with cuBLASLt builds only, as GemmFp8.
OrtStatus* cast_fp8_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  const bool with_amax = kernel.cast_amax;
  Tensor x, scale, y, amax;
  if (OrtStatus* st = input(ctx, 0, &x)) return st;
  if (OrtStatus* st = input(ctx, 1, &scale)) return st;
  if (x.type != MPG_FLOAT && x.type != MPG_FLOAT16 && x.type != MPG_BFLOAT16)
    return status("CastToFloat8: X must be float32, float16 or bfloat16");
  if (scale.type != MPG_FLOAT || scale.count != 1) return status("CastToFloat8: scale must be one float32");
  if (OrtStatus* st = output(ctx, 0, x.dims, &y)) return st;
  if (with_amax)
    if (OrtStatus* st = output(ctx, 1, {}, &amax)) return st;
  const int to = y.type;  // the op's fp8 type
  if (!kernel.cuda) {
    const float s = scale.data[0];
    uint8_t* out = reinterpret_cast<uint8_t*>(y.data);
    uint32_t m = 0;
    for (size_t i = 0; i < x.count; ++i) {
      const float v = load_cpu(x.data, x.type, i);
      m = std::max(m, magnitude_bits(v));
      out[i] = float_to_fp8(v * s, to);
    }
    if (with_amax) std::memcpy(amax.data, &m, sizeof(m));
    return nullptr;
  }
  return fp8_on_gpu(ctx, "CastToFloat8", [&](void* stream) {
    return MPG_GEMM_FP8_CUDA(mpg_cast_fp8_cuda(x.data, x.type, static_cast<int64_t>(x.count), scale.data, y.data, to,
                                                       with_amax ? amax.data : nullptr, stream));
  });
}

// CastTransposeToFloat8E4M3FN(X, scale) -> (Q, QT, Amax), CastTransposeToFloat8E5M2: Q and Amax as
// CastToFloat8*Amax, and QT [cols, rows] = Q^T with X's leading dims flattened into rows (as
// Fp8Transpose(Q)), from one read of X: an fp8 operand one GemmFp8 reads as it is and another
// transposed (fp8_gemm.py rule 9). CUDA with cuBLASLt builds only, as GemmFp8.
OrtStatus* cast_transpose_fp8_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor x, scale, q, qt, amax;
  if (OrtStatus* st = input(ctx, 0, &x)) return st;
  if (OrtStatus* st = input(ctx, 1, &scale)) return st;
  if (x.type != MPG_FLOAT && x.type != MPG_FLOAT16 && x.type != MPG_BFLOAT16)
    return status("CastTransposeToFloat8: X must be float32, float16 or bfloat16");
  if (x.dims.size() < 2) return status("CastTransposeToFloat8: X must have two dims or more");
  if (scale.type != MPG_FLOAT || scale.count != 1) return status("CastTransposeToFloat8: scale must be one float32");
  const int64_t cols = x.dims.back(), rows = cols ? static_cast<int64_t>(x.count) / cols : 0;
  if (OrtStatus* st = output(ctx, 0, x.dims, &q)) return st;
  if (OrtStatus* st = output(ctx, 1, {cols, rows}, &qt)) return st;
  if (OrtStatus* st = output(ctx, 2, {}, &amax)) return st;
  const int to = q.type;
  if (!kernel.cuda) {
    const float s = scale.data[0];
    uint8_t* out = reinterpret_cast<uint8_t*>(q.data);
    uint8_t* flipped = reinterpret_cast<uint8_t*>(qt.data);
    uint32_t m = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        const float v = load_cpu(x.data, x.type, i);
        m = std::max(m, magnitude_bits(v));
        out[i] = flipped[c * rows + r] = float_to_fp8(v * s, to);
      }
    std::memcpy(amax.data, &m, sizeof(m));
    return nullptr;
  }
  return fp8_on_gpu(ctx, "CastTransposeToFloat8", [&](void* stream) {
    return MPG_GEMM_FP8_CUDA(mpg_cast_transpose_fp8_cuda(x.data, x.type, rows, cols, scale.data, q.data, qt.data, to,
                                                                 amax.data, stream));
  });
}

// AbsMax(X) -> amax: max |x| over every element of X (float32, float16 or bfloat16) as a float32
// scalar, a NaN winning (compared as the bits of |x|), 0 for an empty X: ReduceMax(Abs(X)) in one
// read of X, the amax of an fp8 tensor (fp8_gemm.py rule 6). CUDA with cuBLASLt builds only, as
// GemmFp8.
OrtStatus* absmax_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor x, y;
  if (OrtStatus* st = input(ctx, 0, &x)) return st;
  if (x.type != MPG_FLOAT && x.type != MPG_FLOAT16 && x.type != MPG_BFLOAT16)
    return status("AbsMax: X must be float32, float16 or bfloat16");
  if (OrtStatus* st = output(ctx, 0, {}, &y)) return st;
  if (!kernel.cuda) {
    uint32_t m = 0;
    for (size_t i = 0; i < x.count; ++i) m = std::max(m, magnitude_bits(load_cpu(x.data, x.type, i)));
    std::memcpy(y.data, &m, sizeof(m));
    return nullptr;
  }
  return fp8_on_gpu(ctx, "AbsMax", [&](void* stream) {
    return MPG_GEMM_FP8_CUDA(mpg_absmax_cuda(x.data, x.type, static_cast<int64_t>(x.count), y.data, stream));
  });
}

// RotaryEmbedding(X, cos_cache, sin_cache[, position_ids]) -> Y: ONNX's RotaryEmbedding (opset 23,
// the same inputs and attributes) in one pass (rotary.cu; ORT's CUDA kernel takes ~41 us a call
// at Llama's shapes). Rows are X's contiguous head_size blocks; each rotated pair is MLAS's
// arithmetic (ORT CPU's AVX2 rope) in float, one rounding per output:
//   y1 = fma(x1, cos, -(x2 * sin)),  y2 = fma(x1, sin, x2 * cos)
// CPU: float32 (ORT CPU's bits where MLAS takes its AVX2 path); CUDA: float32, float16, bfloat16.
// Beyond ONNX's op: caches [1, S, rotary_dim / 2] without position_ids serve every batch row (the
// rule reads them before the Expand the graph has), and negate_sin = 1 rotates by -sin (the
// gradient's Neg, exact).
bool rotary_shape(const Kernel& k, const Tensor& x, const Tensor& c, const Tensor* pos, RotaryShape* p, int64_t* rows,
                  std::string* why) {
  if (x.dims.size() == 4) {
    p->heads = x.dims[1], p->seq = x.dims[2], p->head = static_cast<int>(x.dims[3]), p->bnsh = 1;
  } else if (x.dims.size() == 3 && k.rot_heads > 0 && x.dims[2] % k.rot_heads == 0) {
    p->seq = x.dims[1], p->heads = k.rot_heads, p->head = static_cast<int>(x.dims[2] / k.rot_heads), p->bnsh = 0;
  } else {
    *why = "X must be 4-D, or 3-D with num_heads dividing its last dim";
    return false;
  }
  p->rdim = k.rot_dim > 0 ? static_cast<int>(k.rot_dim) : p->head;
  p->interleaved = k.rot_interleaved != 0;
  *rows = x.dims[0] * p->seq * p->heads;
  const int64_t half = p->rdim / 2;
  if (p->rdim % 2 || p->rdim > p->head) *why = "rotary_embedding_dim must be even and at most head_size";
  else if (pos && (pos->dims.size() != 2 || pos->dims[0] != x.dims[0] || pos->dims[1] != p->seq))
    *why = "position_ids must be [batch, sequence]";
  else if (pos && (c.dims.size() != 2 || c.dims[1] != half)) *why = "with position_ids the caches must be [positions, rotary_dim / 2]";
  else if (!pos && (c.dims.size() != 3 || (c.dims[0] != x.dims[0] && c.dims[0] != 1) || c.dims[1] != p->seq ||
                    c.dims[2] != half))
    *why = "without position_ids the caches must be [batch or 1, sequence, rotary_dim / 2]";
  p->cache_b1 = !pos && c.dims.size() == 3 && c.dims[0] == 1;
  p->neg_sin = k.rot_neg_sin != 0;
  return why->empty();
}

void rotary_cpu_row(const float* x, const float* c, const float* s, float* y, const RotaryShape& p) {
  const int half = p.rdim / 2;
  for (int k = 0; k < half; ++k) {
    const int i1 = p.interleaved ? 2 * k : k, i2 = p.interleaved ? 2 * k + 1 : k + half;
    const float x1 = x[i1], x2 = x[i2], sk = p.neg_sin ? -s[k] : s[k];
    y[i1] = std::fma(x1, c[k], -(x2 * sk));
    y[i2] = std::fma(x1, sk, x2 * c[k]);
  }
  for (int i = p.rdim; i < p.head; ++i) y[i] = x[i];
}

OrtStatus* rotary_compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(kernel_ptr);
  Tensor x, c, s, pos, y;
  for (auto [i, t] : {std::pair<size_t, Tensor*>{0, &x}, {1, &c}, {2, &s}})
    if (OrtStatus* st = input(ctx, i, t)) return st;
  bool has_pos = false;
  if (OrtStatus* st = optional_input(ctx, 3, &pos, &has_pos)) return st;
  const Tensor* pp = has_pos ? &pos : nullptr;
  if (c.type != x.type || s.type != x.type || s.dims != c.dims) return status("RotaryEmbedding: cos/sin caches must match X's type and each other");
  RotaryShape p{};
  int64_t rows = 0;
  std::string why;
  if (!rotary_shape(kernel, x, c, pp, &p, &rows, &why)) return status("RotaryEmbedding: " + why);
  if (OrtStatus* st = output(ctx, 0, x.dims, &y)) return st;
  if (y.count == 0) return nullptr;
  const int64_t* ids = pp ? reinterpret_cast<const int64_t*>(pos.data) : nullptr;
  if (!kernel.cuda) {
    if (x.type != MPG_FLOAT) return status("RotaryEmbedding: the CPU kernel is float32 only");
    const int64_t half = p.rdim / 2, positions = pp ? c.dims[0] : 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t bs = p.bnsh ? r / (p.heads * p.seq) * p.seq + r % p.seq : r / p.heads;
      const int64_t at = ids ? ids[bs] : p.cache_b1 ? bs % p.seq : bs;
      if (ids && (at < 0 || at >= positions)) return status("RotaryEmbedding: a position id is outside the caches");
      rotary_cpu_row(x.data + r * p.head, c.data + at * half, s.data + at * half, y.data + r * p.head, p);
    }
    return nullptr;
  }
  return on_gpu(ctx, "RotaryEmbedding", [&](void* stream) {
    return MPG_CUDA(mpg_rotary_cuda(x.type, x.data, c.data, s.data, ids, y.data, p, rows, stream));
  });
}

// -- the ops' callbacks ----------------------------------------------------------------------

const char* kCpu = "CPUExecutionProvider";
const char* kCuda = "CUDAExecutionProvider";

enum { kCudaOnly = 1, kCpuOnly = 2 };

enum { MPG_REQUIRED = 0, MPG_OPTIONAL = 1, MPG_VARIADIC = 2, MPG_ANY_TYPE = 0, MPG_BOOL = 9, MPG_INT64 = 7 };

// What ORT asks of an op: its formal inputs and outputs; a variadic formal is the last one.
struct OpSpec {
  const char* name;
  int elem;          // nonzero: every input and output has this type (one registration per type)
  int only;          // 0: both providers; kCudaOnly or kCpuOnly
  size_t inputs, outputs;
  int in_types[2];   // the first formal inputs' types are float; these are the last two's
  int out_types[2];  // the same for outputs
  bool variadic;     // the last input and the last output are variadic
  int in_min, in_homogeneous, out_min;
  OrtStatus* (*compute)(void*, OrtKernelContext*);
};

const OpSpec kSpecs[] = {
    {"AdamWUpdate", 0, 0, 11, 3, {MPG_FLOAT, MPG_FLOAT}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, adamw_compute},
    {"LayerNormGrad", 0, 0, 5, 3, {MPG_FLOAT, MPG_FLOAT}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, layernorm_grad_plain},
    {"LayerNormGradBias", 0, 0, 5, 4, {MPG_FLOAT, MPG_FLOAT}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, layernorm_grad_bias},
    {"MultiAdamWUpdate", 0, 0, 8, 1, {MPG_FLOAT, MPG_FLOAT}, {MPG_FLOAT, MPG_FLOAT}, true, 4, 1, 3, multi_adamw_compute},
    {"CastToBFloat16", 0, 0, 1, 1, {MPG_FLOAT, MPG_FLOAT}, {MPG_BFLOAT16, MPG_BFLOAT16}, true, 1, 1, 1, cast_bf16_compute},
    {"CastToFloat16", 0, 0, 1, 1, {MPG_FLOAT, MPG_FLOAT}, {MPG_FLOAT16, MPG_FLOAT16}, true, 1, 1, 1, cast_f16_compute},
    {"UnscaleGradients", 0, 0, 2, 2, {MPG_FLOAT, MPG_ANY_TYPE}, {MPG_BOOL, MPG_FLOAT}, true, 1, 0, 1, unscale_compute},
    {"ErfGelu", MPG_FLOAT, 0, 4, 1, {}, {}, false, 1, 0, 1, gelu_forward_compute},
    {"ErfGelu", MPG_FLOAT16, kCudaOnly, 4, 1, {}, {}, false, 1, 0, 1, gelu_forward_compute},
    {"ErfGelu", MPG_BFLOAT16, kCudaOnly, 4, 1, {}, {}, false, 1, 0, 1, gelu_forward_compute},
    {"ErfGeluGrad", MPG_FLOAT, 0, 6, 1, {}, {}, false, 1, 0, 1, gelu_grad_compute},
    {"ErfGeluGrad", MPG_FLOAT16, kCudaOnly, 6, 1, {}, {}, false, 1, 0, 1, gelu_grad_compute},
    {"ErfGeluGrad", MPG_BFLOAT16, kCudaOnly, 6, 1, {}, {}, false, 1, 0, 1, gelu_grad_compute},
    {"TanhGeluGrad", MPG_FLOAT, 0, 7, 1, {}, {}, false, 1, 0, 1, tanh_gelu_grad_compute},
    {"TanhGeluGrad", MPG_FLOAT16, kCudaOnly, 7, 1, {}, {}, false, 1, 0, 1, tanh_gelu_grad_compute},
    {"TanhGeluGrad", MPG_BFLOAT16, kCudaOnly, 7, 1, {}, {}, false, 1, 0, 1, tanh_gelu_grad_compute},
    {"SoftmaxGradDot", MPG_FLOAT, 0, 4, 1, {}, {}, false, 1, 0, 1, softmax_grad_dot_compute},
    {"SoftmaxGradDot", MPG_FLOAT16, kCudaOnly, 4, 1, {}, {}, false, 1, 0, 1, softmax_grad_dot_compute},
    {"SoftmaxGradDot", MPG_BFLOAT16, kCudaOnly, 4, 1, {}, {}, false, 1, 0, 1, softmax_grad_dot_compute},
    // x, scale, eps float32; dy... variadic, float32, float16 or bfloat16 each; the last output variadic of one.
    {"RmsNormGrad", 0, 0, 4, 3, {MPG_FLOAT, MPG_ANY_TYPE}, {MPG_FLOAT, MPG_FLOAT}, true, 1, 0, 1, rmsnorm_grad_compute},
    {"RmsNormGradAdd", 0, 0, 5, 3, {MPG_FLOAT, MPG_ANY_TYPE}, {MPG_FLOAT, MPG_FLOAT}, true, 1, 0, 1, rmsnorm_grad_add_compute},
    {"SwiGlu", MPG_FLOAT, 0, 2, 2, {}, {}, false, 1, 0, 1, swiglu_compute},
    {"SwiGlu", MPG_FLOAT16, kCudaOnly, 2, 2, {}, {}, false, 1, 0, 1, swiglu_compute},
    {"SwiGlu", MPG_BFLOAT16, kCudaOnly, 2, 2, {}, {}, false, 1, 0, 1, swiglu_compute},
    {"SwiGluGrad", MPG_FLOAT, 0, 4, 2, {}, {}, false, 1, 0, 1, swiglu_grad_compute},
    {"SwiGluGrad", MPG_FLOAT16, kCudaOnly, 4, 2, {}, {}, false, 1, 0, 1, swiglu_grad_compute},
    {"SwiGluGrad", MPG_BFLOAT16, kCudaOnly, 4, 2, {}, {}, false, 1, 0, 1, swiglu_grad_compute},
    {"ReluGrad", MPG_FLOAT, 0, 2, 1, {}, {}, false, 1, 0, 1, relu_grad_compute},
    {"ReluGrad", MPG_FLOAT16, kCudaOnly, 2, 1, {}, {}, false, 1, 0, 1, relu_grad_compute},
    {"ReluGrad", MPG_BFLOAT16, kCudaOnly, 2, 1, {}, {}, false, 1, 0, 1, relu_grad_compute},
    {"SoftmaxCrossEntropyGrad", 0, 0, 3, 1, {MPG_INT64, MPG_FLOAT}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, sce_grad_compute},
    {"Permute", 0, kCpuOnly, 2, 1, {MPG_FLOAT, MPG_INT64}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, permute_compute},
    {"AdamScalars", 0, 0, 5, 2, {MPG_DOUBLE, MPG_DOUBLE}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, adam_scalars_compute},
    // Stats (SdpaForward's output 1, SdpaBackward's input 5) is float32 whatever elem says.
    {"SdpaForward", MPG_FLOAT, kCpuOnly, 3, 2, {}, {}, false, 1, 0, 1, sdpa_forward_compute},
    {"SdpaBackward", MPG_FLOAT, kCpuOnly, 6, 3, {}, {}, false, 1, 0, 1, sdpa_backward_compute},
    // logits T; labels int64; loss, stats, count and dloss float32 (input_type, output_type).
    {"SoftmaxCrossEntropyRows", MPG_FLOAT, 0, 2, 3, {}, {}, false, 1, 0, 1, ce_rows_compute},
    {"SoftmaxCrossEntropyRows", MPG_FLOAT16, kCudaOnly, 2, 3, {}, {}, false, 1, 0, 1, ce_rows_compute},
    {"SoftmaxCrossEntropyRows", MPG_BFLOAT16, kCudaOnly, 2, 3, {}, {}, false, 1, 0, 1, ce_rows_compute},
    {"SoftmaxCrossEntropyRowsGrad", MPG_FLOAT, 0, 5, 1, {}, {}, false, 1, 0, 1, ce_rows_grad_compute},
    {"SoftmaxCrossEntropyRowsGrad", MPG_FLOAT16, kCudaOnly, 5, 1, {}, {}, false, 1, 0, 1, ce_rows_grad_compute},
    {"SoftmaxCrossEntropyRowsGrad", MPG_BFLOAT16, kCudaOnly, 5, 1, {}, {}, false, 1, 0, 1, ce_rows_grad_compute},
    // inputs and outputs variadic, each float32, float16 or bfloat16 (the outputs' types from the graph).
    {"Pointwise", 0, 0, 1, 1, {MPG_ANY_TYPE, MPG_ANY_TYPE}, {MPG_ANY_TYPE, MPG_ANY_TYPE}, true, 1, 0, 1, pointwise_compute},
    {"GemmBias", MPG_FLOAT16, kCpuOnly, 3, 1, {}, {}, false, 1, 0, 1, gemm_bias_compute},
    {"GemmBias", MPG_BFLOAT16, kCpuOnly, 3, 1, {}, {}, false, 1, 0, 1, gemm_bias_compute},
    {"GemmBiasGelu", MPG_FLOAT16, kCpuOnly, 3, 2, {}, {}, false, 1, 0, 1, gemm_bias_gelu_compute},
    {"GemmBiasGelu", MPG_BFLOAT16, kCpuOnly, 3, 2, {}, {}, false, 1, 0, 1, gemm_bias_gelu_compute},
    // A, B any fp8 type; scaleA, scaleB float32; Y bfloat16 (input_type).
    {"GemmFp8", MPG_BFLOAT16, kCpuOnly, 5, 1, {}, {}, false, 1, 0, 1, gemm_fp8_compute},
    {"Fp8Transpose", 0, kCpuOnly, 1, 1, {MPG_ANY_TYPE, MPG_ANY_TYPE}, {MPG_ANY_TYPE, MPG_ANY_TYPE}, false, 1, 0, 1,
     fp8_transpose_compute},
    {"AbsMax", 0, kCpuOnly, 1, 1, {MPG_ANY_TYPE, MPG_ANY_TYPE}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, absmax_compute},
    // X, caches T; position_ids int64, optional (input_type, input_kind).
    {"RotaryEmbedding", MPG_FLOAT, 0, 4, 1, {}, {}, false, 1, 0, 1, rotary_compute},
    {"RotaryEmbedding", MPG_FLOAT16, kCudaOnly, 4, 1, {}, {}, false, 1, 0, 1, rotary_compute},
    {"RotaryEmbedding", MPG_BFLOAT16, kCudaOnly, 4, 1, {}, {}, false, 1, 0, 1, rotary_compute},
    // X float32/float16/bfloat16, scale float32 (input_type); Q the op's fp8 type (elem).
    {"CastToFloat8E4M3FN", MPG_FLOAT8E4M3FN, kCpuOnly, 2, 1, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    {"CastToFloat8E5M2", MPG_FLOAT8E5M2, kCpuOnly, 2, 1, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    // The same and Amax, float32 (output_type).
    {"CastToFloat8E4M3FNAmax", MPG_FLOAT8E4M3FN, kCpuOnly, 2, 2, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    {"CastToFloat8E5M2Amax", MPG_FLOAT8E5M2, kCpuOnly, 2, 2, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    // The same, QT and Amax float32 (output_type).
    {"CastTransposeToFloat8E4M3FN", MPG_FLOAT8E4M3FN, kCpuOnly, 2, 3, {}, {}, false, 1, 0, 1, cast_transpose_fp8_compute},
    {"CastTransposeToFloat8E5M2", MPG_FLOAT8E5M2, kCpuOnly, 2, 3, {}, {}, false, 1, 0, 1, cast_transpose_fp8_compute},
#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUBLASLT)
    {"GemmBias", MPG_FLOAT16, kCudaOnly, 3, 1, {}, {}, false, 1, 0, 1, gemm_bias_compute},
    {"GemmBias", MPG_BFLOAT16, kCudaOnly, 3, 1, {}, {}, false, 1, 0, 1, gemm_bias_compute},
    {"GemmBiasGelu", MPG_FLOAT16, kCudaOnly, 3, 2, {}, {}, false, 1, 0, 1, gemm_bias_gelu_compute},
    {"GemmBiasGelu", MPG_BFLOAT16, kCudaOnly, 3, 2, {}, {}, false, 1, 0, 1, gemm_bias_gelu_compute},
    {"GemmFp8", MPG_BFLOAT16, kCudaOnly, 5, 1, {}, {}, false, 1, 0, 1, gemm_fp8_compute},
    {"Fp8Transpose", 0, kCudaOnly, 1, 1, {MPG_ANY_TYPE, MPG_ANY_TYPE}, {MPG_ANY_TYPE, MPG_ANY_TYPE}, false, 1, 0, 1,
     fp8_transpose_compute},
    {"AbsMax", 0, kCudaOnly, 1, 1, {MPG_ANY_TYPE, MPG_ANY_TYPE}, {MPG_FLOAT, MPG_FLOAT}, false, 1, 0, 1, absmax_compute},
    {"CastToFloat8E4M3FN", MPG_FLOAT8E4M3FN, kCudaOnly, 2, 1, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    {"CastToFloat8E5M2", MPG_FLOAT8E5M2, kCudaOnly, 2, 1, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    {"CastToFloat8E4M3FNAmax", MPG_FLOAT8E4M3FN, kCudaOnly, 2, 2, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    {"CastToFloat8E5M2Amax", MPG_FLOAT8E5M2, kCudaOnly, 2, 2, {}, {}, false, 1, 0, 1, cast_fp8_compute},
    {"CastTransposeToFloat8E4M3FN", MPG_FLOAT8E4M3FN, kCudaOnly, 2, 3, {}, {}, false, 1, 0, 1, cast_transpose_fp8_compute},
    {"CastTransposeToFloat8E5M2", MPG_FLOAT8E5M2, kCudaOnly, 2, 3, {}, {}, false, 1, 0, 1, cast_transpose_fp8_compute},
#endif
#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUDNN)
    {"SdpaForward", MPG_FLOAT16, kCudaOnly, 3, 2, {}, {}, false, 1, 0, 1, sdpa_forward_compute},
    {"SdpaForward", MPG_BFLOAT16, kCudaOnly, 3, 2, {}, {}, false, 1, 0, 1, sdpa_forward_compute},
    {"SdpaBackward", MPG_FLOAT16, kCudaOnly, 6, 3, {}, {}, false, 1, 0, 1, sdpa_backward_compute},
    {"SdpaBackward", MPG_BFLOAT16, kCudaOnly, 6, 3, {}, {}, false, 1, 0, 1, sdpa_backward_compute},
#endif
};
constexpr size_t kOpCount = sizeof(kSpecs) / sizeof(kSpecs[0]);

struct Op {
  MpgCustomOp base;
  bool cuda;
  const OpSpec* spec;
};

const OpSpec& spec_of(const MpgCustomOp* op) { return *reinterpret_cast<const Op*>(op)->spec; }
const char* op_name(const MpgCustomOp* op) { return spec_of(op).name; }
const char* op_provider(const MpgCustomOp* op) { return reinterpret_cast<const Op*>(op)->cuda ? kCuda : kCpu; }
int typed(size_t index, size_t count, const int* last_two) {
  return index + 2 >= count ? last_two[index + 2 - count] : MPG_FLOAT;
}
int input_type(const MpgCustomOp* op, size_t index) {
  if (spec_of(op).compute == layernorm_grad_bias && index == 0) return MPG_ANY_TYPE;  // dy: float, float16, bfloat16
  if (spec_of(op).compute == adam_scalars_compute && index >= 2) return MPG_DOUBLE;  // beta1, beta2, one
  if (spec_of(op).compute == sdpa_backward_compute && index == 5) return MPG_FLOAT;  // Stats
  if (spec_of(op).compute == rotary_compute && index == 3) return MPG_INT64;  // position_ids
  if (spec_of(op).compute == gemm_fp8_compute)  // A, B fp8; scales; Bias (the op's type, elem)
    return index < 2 ? int{MPG_ANY_TYPE} : index < 4 ? int{MPG_FLOAT} : spec_of(op).elem;
  if (spec_of(op).compute == cast_fp8_compute || spec_of(op).compute == cast_transpose_fp8_compute)
    return index == 0 ? int{MPG_ANY_TYPE} : int{MPG_FLOAT};  // X; scale
  if (spec_of(op).compute == ce_rows_compute || spec_of(op).compute == ce_rows_grad_compute)
    return index == 0 ? spec_of(op).elem : index == 1 ? MPG_INT64 : MPG_FLOAT;  // logits, labels, stats/count/dloss
  return spec_of(op).elem ? spec_of(op).elem : typed(index, spec_of(op).inputs, spec_of(op).in_types);
}
int output_type(const MpgCustomOp* op, size_t index) {
  if (spec_of(op).compute == sdpa_forward_compute && index == 1) return MPG_FLOAT;  // Stats
  if (spec_of(op).compute == ce_rows_compute) return MPG_FLOAT;  // loss, stats, count
  if (spec_of(op).compute == cast_fp8_compute && index == 1) return MPG_FLOAT;  // Amax
  if (spec_of(op).compute == cast_transpose_fp8_compute && index == 2) return MPG_FLOAT;  // Amax
  return spec_of(op).elem ? spec_of(op).elem : typed(index, spec_of(op).outputs, spec_of(op).out_types);
}
size_t op_inputs(const MpgCustomOp* op) { return spec_of(op).inputs; }
size_t op_outputs(const MpgCustomOp* op) { return spec_of(op).outputs; }
int input_kind(const MpgCustomOp* op, size_t index) {
  if (spec_of(op).compute == rotary_compute && index == 3) return MPG_OPTIONAL;  // position_ids
  if (spec_of(op).compute == gemm_fp8_compute && index == 4) return MPG_OPTIONAL;  // Bias
  return spec_of(op).variadic && index + 1 == spec_of(op).inputs ? MPG_VARIADIC : MPG_REQUIRED;
}
int output_kind(const MpgCustomOp* op, size_t index) {
  return spec_of(op).variadic && index + 1 == spec_of(op).outputs ? MPG_VARIADIC : MPG_REQUIRED;
}
int in_min(const MpgCustomOp* op) { return spec_of(op).in_min; }
int in_homogeneous(const MpgCustomOp* op) { return spec_of(op).in_homogeneous; }
int out_min(const MpgCustomOp* op) { return spec_of(op).out_min; }
int out_homogeneous(const MpgCustomOp* op) { return spec_of(op).compute != pointwise_compute; }
int one(const MpgCustomOp*) { return 1; }
void* create_kernel_v1(const MpgCustomOp*, const OrtApi*, const OrtKernelInfo*) { return nullptr; }
void compute_v1(void*, OrtKernelContext*) {}
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
int default_memory(const MpgCustomOp*, size_t) { return 0; }
// An attribute of the node, or ``fallback`` when it has none (false then).
template <typename T>
bool attribute(const OrtApi* api, const OrtKernelInfo* info, MpgOrtSlot slot, const char* name, T fallback, T* out) {
  using Get = OrtStatus* (*)(const OrtKernelInfo*, const char*, T*);
  if (OrtStatus* st = mpg_slot<Get>(api, slot)(info, name, out)) {
    mpg_slot<void (*)(OrtStatus*)>(api, kReleaseStatus)(st);
    *out = fallback;
    return false;
  }
  return true;
}
// A string attribute of the node ("" when it has none).
std::string string_attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  using Get = OrtStatus* (*)(const OrtKernelInfo*, const char*, char*, size_t*);
  size_t size = 0;
  if (OrtStatus* st = mpg_slot<Get>(api, kKernelInfoGetAttribute_string)(info, name, nullptr, &size)) {
    mpg_slot<void (*)(OrtStatus*)>(api, kReleaseStatus)(st);
    return "";
  }
  std::string out(size, '\0');
  if (OrtStatus* st = mpg_slot<Get>(api, kKernelInfoGetAttribute_string)(info, name, &out[0], &size)) {
    mpg_slot<void (*)(OrtStatus*)>(api, kReleaseStatus)(st);
    return "";
  }
  out.resize(size > 0 ? size - 1 : 0);
  return out;
}
OrtStatus* create_kernel(const MpgCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  Kernel* made = new Kernel{reinterpret_cast<const Op*>(op)->cuda, reinterpret_cast<const Op*>(op)->spec};
  if (made->spec->compute == sdpa_forward_compute || made->spec->compute == sdpa_backward_compute) {
    made->has_scale = attribute<float>(api, info, kKernelInfoGetAttribute_float, "scale", 0.0f, &made->scale);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "is_causal", 0, &made->causal);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "q_num_heads", 0, &made->q_heads);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "kv_num_heads", 0, &made->kv_heads);
  }
  if (made->spec->compute == ce_rows_compute || made->spec->compute == ce_rows_grad_compute) {
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "valid_cols", 0, &made->ce_valid_cols);
    made->ce_has_ignore = attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "ignore_index", 0, &made->ce_ignore_index);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "reduction", 0, &made->ce_reduction);
  }
  if (made->spec->compute == gemm_bias_compute || made->spec->compute == gemm_bias_gelu_compute) {
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "transA", 0, &made->gemm_trans_a);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "transB", 0, &made->gemm_trans_b);
    attribute<float>(api, info, kKernelInfoGetAttribute_float, "alpha", 1.0f, &made->gemm_alpha);
  }
  if (made->spec->compute == gemm_fp8_compute)
    attribute<float>(api, info, kKernelInfoGetAttribute_float, "alpha", 1.0f, &made->gemm_alpha);
  made->cast_amax = made->spec->compute == cast_fp8_compute && made->spec->outputs == 2;
  if (made->spec->compute == rotary_compute) {
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "interleaved", 0, &made->rot_interleaved);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "rotary_embedding_dim", 0, &made->rot_dim);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "num_heads", 0, &made->rot_heads);
    attribute<int64_t>(api, info, kKernelInfoGetAttribute_int64, "negate_sin", 0, &made->rot_neg_sin);
  }
  if (made->spec->compute == pointwise_compute) made->pw = pointwise_parse(string_attribute(api, info, "program"),
                                                                          string_attribute(api, info, "outputs"));
  *kernel = made;
  return nullptr;
}
OrtStatus* compute(void* kernel, OrtKernelContext* ctx) { return static_cast<Kernel*>(kernel)->spec->compute(kernel, ctx); }
int start_version(const MpgCustomOp*) { return 1; }
int end_version(const MpgCustomOp*) { return 2147483647; }
// SoftmaxCrossEntropyRowsGrad's dlogits may take its logits' buffer (input 0 -> output 0): each
// element is read, then written, by the same thread, and the logits have no reader after it.
// For GPT-2 small at batch 8 that is one [8192, 50304] bfloat16 buffer (786 MiB) less at the
// step's peak. ORT's callback has no op argument, hence one function per in-place map.
size_t first_in_place(int** input_index, int** output_index) {
  *input_index = static_cast<int*>(std::malloc(sizeof(int)));
  *output_index = static_cast<int*>(std::malloc(sizeof(int)));
  if (!*input_index || !*output_index) {
    std::free(*input_index);
    std::free(*output_index);
    *input_index = *output_index = nullptr;
    return 0;
  }
  **input_index = **output_index = 0;
  return 1;
}
size_t none_in_place(int** input_index, int** output_index) {
  *input_index = *output_index = nullptr;
  return 0;
}
void release_in_place(int* input_index, int* output_index) {
  std::free(input_index);
  std::free(output_index);
}

Op make_op(const OpSpec* spec, bool cuda) {
  Op op;
  std::memset(&op, 0, sizeof(op));
  op.base.version = MPG_ORT_API_VERSION;
  op.base.CreateKernel = create_kernel_v1;
  op.base.GetName = op_name;
  op.base.GetExecutionProviderType = op_provider;
  op.base.GetInputType = input_type;
  op.base.GetInputTypeCount = op_inputs;
  op.base.GetOutputType = output_type;
  op.base.GetOutputTypeCount = op_outputs;
  op.base.KernelCompute = compute_v1;
  op.base.KernelDestroy = destroy;
  op.base.GetInputCharacteristic = input_kind;
  op.base.GetOutputCharacteristic = output_kind;
  op.base.GetInputMemoryType = default_memory;
  op.base.GetVariadicInputMinArity = in_min;
  op.base.GetVariadicInputHomogeneity = in_homogeneous;
  op.base.GetVariadicOutputMinArity = out_min;
  op.base.GetVariadicOutputHomogeneity = out_homogeneous;
  op.base.CreateKernelV2 = create_kernel;
  op.base.KernelComputeV2 = compute;
  op.base.InferOutputShapeFn = nullptr;
  op.base.GetStartVersion = start_version;
  op.base.GetEndVersion = end_version;
  op.base.GetMayInplace = spec->compute == ce_rows_grad_compute ? first_in_place : none_in_place;
  op.base.ReleaseMayInplace = release_in_place;
  op.base.GetAliasMap = none_in_place;
  op.base.ReleaseAliasMap = release_in_place;
  op.cuda = cuda;
  op.spec = spec;
  return op;
}

struct Ops {
  Op ops[2 * kOpCount];
  size_t count = 0;
  Ops() {
    for (size_t i = 0; i < kOpCount; ++i)
      if (kSpecs[i].only != kCudaOnly) ops[count++] = make_op(&kSpecs[i], false);
#ifdef MPG_WITH_CUDA
    for (size_t i = 0; i < kOpCount; ++i)
      if (kSpecs[i].only != kCpuOnly) ops[count++] = make_op(&kSpecs[i], true);
#endif
  }
};

Ops g_ops;

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

// Whether this build has the CUDA GemmBias (cuBLASLt's bias epilogue); the CPU reference is always in.
__attribute__((visibility("default"))) int MpgraphKernelsHaveGemmBias() {
#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUBLASLT)
  return 1;
#else
  return 0;
#endif
}

// Whether this build has the CUDA fused attention (SdpaForward/SdpaBackward through cuDNN);
// the CPU reference kernels are always in.
__attribute__((visibility("default"))) int MpgraphKernelsHaveSdpa() {
#if defined(MPG_WITH_CUDA) && defined(MPG_WITH_CUDNN)
  return 1;
#else
  return 0;
#endif
}

// The in-place pairs (input, output) op ``name`` declares to ORT, written to ``pairs`` (at most
// ``capacity`` pairs); how many it declares (the Python side checks its mirror with ctypes).
__attribute__((visibility("default"))) int MpgraphKernelsMayInplace(const char* name, int* pairs, int capacity) {
  for (size_t i = 0; i < g_ops.count; ++i) {
    if (std::strcmp(g_ops.ops[i].spec->name, name) != 0) continue;
    int* in = nullptr;
    int* out = nullptr;
    const size_t n = g_ops.ops[i].base.GetMayInplace(&in, &out);
    for (size_t k = 0; k < n && static_cast<int>(k) < capacity; ++k) {
      pairs[2 * k] = in[k];
      pairs[2 * k + 1] = out[k];
    }
    g_ops.ops[i].base.ReleaseMayInplace(in, out);
    return static_cast<int>(n);
  }
  return 0;
}

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(MPG_ORT_API_VERSION);
  if (!api) return nullptr;  // an ORT older than 1.17: nothing registered, the graph keeps the plain ops
  g_api = api;
  // An ORT with the in-place callbacks reads them (an older one would refuse the newer version).
  const uint32_t version = base->GetApi(MPG_ORT_INPLACE_VERSION) ? MPG_ORT_INPLACE_VERSION : MPG_ORT_API_VERSION;
  for (size_t i = 0; i < g_ops.count; ++i) g_ops.ops[i].base.version = version;
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = mpg_slot<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(api, kCreateCustomOpDomain)("ai.mpgraph", &domain)) return st;
  auto add = mpg_slot<OrtStatus* (*)(OrtCustomOpDomain*, const MpgCustomOp*)>(api, kCustomOpDomain_Add);
  for (size_t i = 0; i < g_ops.count; ++i)
    if (OrtStatus* st = add(domain, &g_ops.ops[i].base)) return st;
  return mpg_slot<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(api, kAddCustomOpDomain)(options, domain);
}

}  // extern "C"
