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
// matmul with beta = 1; slower, the same math.
#ifdef MPG_WITH_CUBLASLT
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "gemm_bias.h"

namespace {

// cuBLASLt workspace per (device, stream): 32 MiB, what torch gives cuBLASLt on Hopper, so the
// heuristic may pick the same split-K kernels.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// A matmul's descriptors and the algorithm the heuristic chose for them, kept per shape.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  bool broadcast = false;  // no bias-epilogue algorithm: broadcast the bias, then beta = 1
};

// Y[i, j] = bias[j]: 16-bit elements copied as they are (Y and bias share their type).
__global__ void broadcast_rows(const uint16_t* __restrict__ bias, uint16_t* __restrict__ y, int64_t n, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = bias[i % n];
}

// (device, type, m, n, k, trans_a, trans_b, alignment of A, B, bias and Y)
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int, int, int, int, int, int>;

std::mutex g_mutex;  // guards everything below; a launch is queued with it held
std::map<int, cublasLtHandle_t> g_handles;
std::map<std::pair<int, void*>, void*> g_workspaces;
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

// The descriptors of ``s``, with the bias epilogue unless ``broadcast``, and the heuristic's
// first algorithm for them (``*found``: whether there is one).
int describe(cublasLtHandle_t handle, const GemmBiasShape& s, const void* bias, const int* aligns, bool broadcast,
             Plan* plan, bool* found_one) {
  const cudaDataType_t type = s.type == 16 ? CUDA_R_16BF : CUDA_R_16F;
  const cublasOperation_t op_a = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // and its B our A
  const cublasLtEpilogue_t epilogue = broadcast ? CUBLASLT_EPILOGUE_DEFAULT : CUBLASLT_EPILOGUE_BIAS;
  plan->broadcast = broadcast;
  MPG_LT(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (!broadcast) {
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)));
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  // Stored shapes, column-major: our B [K, N] is N x K (ld N), [N, K] is K x N (ld K);
  // our A [M, K] is K x M (ld K), [K, M] is M x K (ld M); Y [M, N] is N x M (ld N).
  const uint64_t n = static_cast<uint64_t>(s.n), m = static_cast<uint64_t>(s.m), k = static_cast<uint64_t>(s.k);
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->a, type, s.trans_b ? k : n, s.trans_b ? n : k, static_cast<int64_t>(s.trans_b ? k : n)));
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->b, type, s.trans_a ? m : k, s.trans_a ? k : m, static_cast<int64_t>(s.trans_a ? m : k)));
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->d, type, n, m, static_cast<int64_t>(n)));
  cublasLtMatmulPreference_t pref = nullptr;
  MPG_LT(cublasLtMatmulPreferenceCreate(&pref));
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  const uint32_t operand_align[4] = {static_cast<uint32_t>(aligns[1]), static_cast<uint32_t>(aligns[0]),
                                     static_cast<uint32_t>(aligns[3]), static_cast<uint32_t>(aligns[3])};
  size_t workspace = kWorkspaceBytes;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                           sizeof(workspace));
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
    st = cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &operand_align[i], sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t found;
  int returned = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1, &found, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  *found_one = st == CUBLAS_STATUS_SUCCESS && returned > 0;
  if (*found_one) plan->algo = found.algo;
  return 0;
}

void destroy(Plan* plan);

// The bias-epilogue plan, or the broadcast one where cuBLASLt has no algorithm for the first.
int make_plan(cublasLtHandle_t handle, const GemmBiasShape& s, const void* bias, const int* aligns, Plan* plan) {
  bool found = false;
  if (int rc = describe(handle, s, bias, aligns, false, plan, &found)) return rc;
  if (found) return 0;
  destroy(plan);
  *plan = Plan();
  if (int rc = describe(handle, s, bias, aligns, true, plan, &found)) return rc;
  return found ? 0 : fail("cuBLASLt has no algorithm for this GEMM", static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED));
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
                                  void* stream_ptr) {
  const GemmBiasShape& s = *shape;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::lock_guard<std::mutex> lock(g_mutex);
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device)) return fail("cudaGetDevice", static_cast<int>(err));
  cublasLtHandle_t& handle = g_handles[device];
  if (!handle) MPG_LT(cublasLtCreate(&handle));
  void*& workspace = g_workspaces[{device, stream_ptr}];
  if (!workspace) {
    if (cudaError_t err = cudaMalloc(&workspace, kWorkspaceBytes)) {
      workspace = nullptr;
      return fail("cudaMalloc of the cuBLASLt workspace", static_cast<int>(err));
    }
  }
  const int aligns[4] = {alignment(a), alignment(b), alignment(bias), alignment(y)};
  const PlanKey key{device, s.type, s.m, s.n, s.k, s.trans_a, s.trans_b, aligns[0], aligns[1], aligns[2], aligns[3]};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    Plan plan;
    if (int rc = make_plan(handle, s, bias, aligns, &plan)) {
      destroy(&plan);
      return rc;
    }
    it = g_plans.emplace(key, plan).first;
  }
  Plan& plan = it->second;
  if (plan.broadcast) {
    const int64_t total = s.m * s.n;
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
    broadcast_rows<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), s.n, total);
    if (cudaError_t err = cudaGetLastError()) return fail("broadcast_rows launch", static_cast<int>(err));
  } else {
    MPG_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  const float alpha = s.alpha, beta = plan.broadcast ? 1.0f : 0.0f;
  MPG_LT(cublasLtMatmul(handle, plan.desc, &alpha, b, plan.a, a, plan.b, &beta, y, plan.d, y, plan.d, &plan.algo,
                        workspace, kWorkspaceBytes, stream));
  return 0;
}
#endif  // MPG_WITH_CUBLASLT
