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
#endif
