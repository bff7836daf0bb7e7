// GemmBias on CUDA: one cuBLASLt matmul whose epilogue adds the bias (CUBLASLT_EPILOGUE_BIAS),
// as torch.compile's addmm does (the nvjet "..._bias_..." kernels), instead of ORT's Gemm,
// which first broadcasts C into Y (BroadcastBiasKernel) and then runs the GEMM with beta = 1.
// The interface is in gemm_bias.h. Built only with cuBLASLt (MPG_WITH_CUBLASLT, build.py's
// cublaslt_flags); otherwise this file is empty and the library registers no CUDA GemmBias.
//
// Row-major Y = A' B' is column-major Y^T = B'^T A'^T, so cuBLASLt's "A" is our B and its "B"
// our A, each in its own storage with the transposition flag it carries; D is column-major
// [N, M] with leading dimension N, and the bias runs along D's rows, one value per column of Y.
//
// Where the heuristic has no bias-epilogue algorithm for a shape and alignment (unaligned
// leading dimensions), the op does what ORT's Gemm does: the bias broadcast into Y, then the
// matmul with beta = 1; slower, the same math. GemmBiasGelu (``pre`` given) uses
// CUBLASLT_EPILOGUE_GELU_AUX_BIAS (``pre`` is its aux output, leading dimension N, which must be a
// multiple of 8); without an algorithm for it, the plain GemmBias into ``pre`` and then an
// elementwise tanh GELU of the rounded ``pre`` (what ORT's Gelu computes).
#ifdef MPG_WITH_CUBLASLT
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "cuda_util.h"
#include "cublaslt_context.h"
#include "gemm_bias.h"

namespace {

// How a plan adds the bias (and the GELU): in the epilogue; in the epilogue with GELU and its
// aux; or broadcast into D before a matmul with beta = 1.
enum Mode { kBias, kGeluAux, kBroadcast };

// A matmul's descriptors and the algorithm the heuristic chose for them, kept per shape.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  Mode mode = kBias;
};

// y = gelu_tanh(x) elementwise, x as it is stored (the fallback of GemmBiasGelu).
template <typename T>
__global__ void gelu_tanh(const T* __restrict__ x, T* __restrict__ y, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = to_f(x[i]);
    y[i] = from_f<T>(0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))));
  }
}

// Y[i, j] = bias[j]: 16-bit elements copied as they are (Y and bias share their type).
__global__ void broadcast_rows(const uint16_t* __restrict__ bias, uint16_t* __restrict__ y, int64_t n, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = bias[i % n];
}

// (device, type, m, n, k, trans_a, trans_b, alignment of A, B, bias, Y and pre (0: no GELU))
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int, int, int, int, int, int, int>;

std::mutex g_mutex;  // guards everything below; a launch is queued with it held
std::map<PlanKey, Plan> g_plans;
std::string g_error;

int fail(const std::string& what, int code) {
  g_error = what + " (status " + std::to_string(code) + ")";
  return code ? code : -1;
}

// The largest power of two up to 256 dividing the address: the alignment cuBLASLt may assume.
int alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && address % static_cast<uintptr_t>(align)) align /= 2;
  return align;
}

#define MPG_LT(call)                                         \
  do {                                                       \
    const cublasStatus_t st_ = (call);                       \
    if (st_ != CUBLAS_STATUS_SUCCESS) return fail(#call, static_cast<int>(st_)); \
  } while (0)

// The descriptors of ``s`` for ``mode``, and the heuristic's first algorithm for them
// (``*found_one``: whether there is one).
int describe(cublasLtHandle_t handle, const GemmBiasShape& s, const void* bias, const void* pre, const int* aligns,
             Mode mode, Plan* plan, bool* found_one) {
  const cudaDataType_t type = s.type == 16 ? CUDA_R_16BF : CUDA_R_16F;
  const cublasOperation_t op_a = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // and its B our A
  const cublasLtEpilogue_t epilogue = mode == kBroadcast ? CUBLASLT_EPILOGUE_DEFAULT
                                      : mode == kGeluAux ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
  plan->mode = mode;
  MPG_LT(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (mode != kBroadcast) {
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)));
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (mode == kGeluAux) {
    const int64_t ld = s.n;
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &pre, sizeof(pre)));
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
  }
  // Stored shapes, column-major: our B [K, N] is N x K (ld N), [N, K] is K x N (ld K);
  // our A [M, K] is K x M (ld K), [K, M] is M x K (ld M); Y [M, N] is N x M (ld N).
  const uint64_t n = static_cast<uint64_t>(s.n), m = static_cast<uint64_t>(s.m), k = static_cast<uint64_t>(s.k);
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->a, type, s.trans_b ? k : n, s.trans_b ? n : k, static_cast<int64_t>(s.trans_b ? k : n)));
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->b, type, s.trans_a ? m : k, s.trans_a ? k : m, static_cast<int64_t>(s.trans_a ? m : k)));
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->d, type, n, m, static_cast<int64_t>(n)));
  const uint32_t operand_align[4] = {static_cast<uint32_t>(aligns[1]), static_cast<uint32_t>(aligns[0]),
                                     static_cast<uint32_t>(aligns[3]), static_cast<uint32_t>(aligns[3])};
  if (int st = mpg_lt_first_algo(handle, plan->desc, plan->a, plan->b, plan->d, operand_align, &plan->algo, found_one))
    return fail("cublasLtMatmulPreferenceCreate(&pref)", st);
  return 0;
}

void destroy(Plan* plan);

// The first of the GELU-aux (with ``pre``; its aux LD a multiple of 8), bias-epilogue and
// broadcast plans that cuBLASLt has an algorithm for.
int make_plan(cublasLtHandle_t handle, const GemmBiasShape& s, const void* bias, const void* pre, const int* aligns,
              Plan* plan) {
  const Mode modes[3] = {kGeluAux, kBias, kBroadcast};
  for (Mode mode : modes) {
    if (mode == kGeluAux && (!pre || s.n % 8)) continue;
    bool found = false;
    if (int rc = describe(handle, s, bias, pre, aligns, mode, plan, &found)) return rc;
    if (found) return 0;
    destroy(plan);
    *plan = Plan();
  }
  return fail("cuBLASLt has no algorithm for this GEMM", static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED));
}

void destroy(Plan* plan) {
  if (plan->a) cublasLtMatrixLayoutDestroy(plan->a);
  if (plan->b) cublasLtMatrixLayoutDestroy(plan->b);
  if (plan->d) cublasLtMatrixLayoutDestroy(plan->d);
  if (plan->desc) cublasLtMatmulDescDestroy(plan->desc);
}

}  // namespace

extern "C" const char* mpg_gemm_bias_last_error() { return g_error.c_str(); }

extern "C" int mpg_gemm_bias_cuda(const GemmBiasShape* shape, const void* a, const void* b, const void* bias, void* y,
                                  void* pre, void* stream_ptr) {
  const GemmBiasShape& s = *shape;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::lock_guard<std::mutex> lock(g_mutex);
  int device = 0;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::string what;
  if (int err = mpg_lt_context(stream_ptr, &device, &handle, &workspace, &what)) return fail(what, err);
  const int aligns[4] = {alignment(a), alignment(b), alignment(bias), alignment(y)};
  const int pre_align = pre ? alignment(pre) : 0;
  const PlanKey key{device, s.type, s.m, s.n, s.k, s.trans_a, s.trans_b, aligns[0], aligns[1], aligns[2], aligns[3], pre_align};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    Plan plan;
    if (int rc = make_plan(handle, s, bias, pre, aligns, &plan)) {
      destroy(&plan);
      return rc;
    }
    it = g_plans.emplace(key, plan).first;
  }
  Plan& plan = it->second;
  // D: Y, or (GemmBiasGelu without the GELU epilogue) pre, which the GELU kernel then reads.
  void* d = pre && plan.mode != kGeluAux ? pre : y;
  const int64_t total = s.m * s.n;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
  if (plan.mode == kBroadcast) {
    broadcast_rows<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(d), s.n, total);
    if (cudaError_t err = cudaGetLastError()) return fail("broadcast_rows launch", static_cast<int>(err));
  } else {
    MPG_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (plan.mode == kGeluAux)
    MPG_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &pre, sizeof(pre)));
  const float alpha = s.alpha, beta = plan.mode == kBroadcast ? 1.0f : 0.0f;
  MPG_LT(cublasLtMatmul(handle, plan.desc, &alpha, b, plan.a, a, plan.b, &beta, d, plan.d, d, plan.d, &plan.algo,
                        workspace, kLtWorkspaceBytes, stream));
  if (pre && plan.mode != kGeluAux) {
    if (s.type == 16)
      gelu_tanh<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(pre), static_cast<__nv_bfloat16*>(y), total);
    else
      gelu_tanh<<<blocks, 256, 0, stream>>>(static_cast<const __half*>(pre), static_cast<__half*>(y), total);
    if (cudaError_t err = cudaGetLastError()) return fail("gelu_tanh launch", static_cast<int>(err));
  }
  return 0;
}
#endif  // MPG_WITH_CUBLASLT
