// The CUDA side of SoftmaxGradDot (see kernels.cc): one warp per row. The warp sums
// dO * O over the row's head dim (in float, then rounded to T as the graph's Cast did), then
// writes dS = P * (dP - delta) over the row's keys, rounding each step to T.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_util.h"
#include "multi.h"

namespace {

constexpr int kWarpsPerBlock = 8;

template <typename T>
__global__ void softmax_grad_dot_kernel(const T* __restrict__ dp, const T* __restrict__ p, const T* __restrict__ dout,
                                        const T* __restrict__ out, T* __restrict__ ds, size_t rows, size_t keys,
                                        size_t dim) {
  const size_t row = (size_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0.0f;
  for (size_t j = lane; j < dim; j += 32) acc += __fmul_rn(to_f(dout[row * dim + j]), to_f(out[row * dim + j]));
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  const float delta = r<T>(acc);
  for (size_t j = lane; j < keys; j += 32) {
    const size_t k = row * keys + j;
    ds[k] = from_f<T>(__fmul_rn(to_f(p[k]), r<T>(__fsub_rn(to_f(dp[k]), delta))));
  }
}

template <typename T>
int launch(const void* dp, const void* p, const void* dout, const void* out, void* ds, size_t rows, size_t keys,
           size_t dim, cudaStream_t s) {
  const unsigned blocks = (unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  softmax_grad_dot_kernel<T><<<blocks, 32 * kWarpsPerBlock, 0, s>>>(
      static_cast<const T*>(dp), static_cast<const T*>(p), static_cast<const T*>(dout), static_cast<const T*>(out),
      static_cast<T*>(ds), rows, keys, dim);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int mpg_softmax_grad_dot_cuda(int type, const void* dp, const void* p, const void* dout, const void* out,
                                         void* ds, size_t rows, size_t keys, size_t dim, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16) return launch<__nv_bfloat16>(dp, p, dout, out, ds, rows, keys, dim, s);
  if (type == kTypeFloat16) return launch<__half>(dp, p, dout, out, ds, rows, keys, dim, s);
  return launch<float>(dp, p, dout, out, ds, rows, keys, dim, s);
}
