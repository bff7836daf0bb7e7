// See cublaslt_context.h.
#ifdef MPG_WITH_CUBLASLT
#include "cublaslt_context.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

namespace {

std::mutex g_mutex;  // guards the two maps
std::map<int, cublasLtHandle_t> g_handles;
std::map<std::pair<int, void*>, void*> g_workspaces;

}  // namespace

int mpg_lt_context(void* stream, int* device, cublasLtHandle_t* handle, void** workspace, std::string* what) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (cudaError_t err = cudaGetDevice(device)) {
    *what = "cudaGetDevice";
    return static_cast<int>(err);
  }
  cublasLtHandle_t& h = g_handles[*device];
  if (!h) {
    if (cublasStatus_t st = cublasLtCreate(&h)) {
      h = nullptr;
      *what = "cublasLtCreate(&handle)";
      return static_cast<int>(st);
    }
  }
  void*& w = g_workspaces[{*device, stream}];
  if (!w) {
    if (cudaError_t err = cudaMalloc(&w, kLtWorkspaceBytes)) {
      w = nullptr;
      *what = "cudaMalloc of the cuBLASLt workspace";
      return static_cast<int>(err);
    }
  }
  *handle = h;
  *workspace = w;
  return 0;
}

int mpg_lt_first_algo(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                      cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, const uint32_t* aligns,
                      cublasLtMatmulAlgo_t* algo, bool* found) {
  *found = false;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref)) return static_cast<int>(st);
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  size_t workspace = kLtWorkspaceBytes;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                           sizeof(workspace));
  for (int i = 0; aligns && i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
    st = cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t result;
  int returned = 0;
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  *found = st == CUBLAS_STATUS_SUCCESS && returned > 0;
  if (*found) *algo = result.algo;
  return 0;
}
#endif
