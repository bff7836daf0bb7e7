// The CUDA side of ReluGrad and SoftmaxCrossEntropyGrad (see kernels.cc): elementwise, each
// operation rounded on its own as the ONNX ops it replaces do.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_util.h"
#include "multi.h"

namespace {

unsigned blocks_for(size_t n) {
  size_t b = (n + 255) / 256;
  if (b > 8192) b = 8192;
  return b ? (unsigned)b : 1u;
}

// dx = dy * (x > 0 ? 1 : 0): the Relu rule's Mul(dy, Cast(Greater(x, 0))).
template <typename T>
__global__ void relu_grad_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dx[i] = from_f<T>(__fmul_rn(to_f(dy[i]), to_f(x[i]) > 0.0f ? 1.0f : 0.0f));
}

// d = (exp(log_prob) - one_hot(index)) * scale, over [rows, classes]; scale has one value per
// row or one in all (``scale_per_row``). OneHot's rules: a negative index counts from the end,
// one out of range makes no hot entry.
__global__ void sce_grad_kernel(const float* __restrict__ log_prob, const int64_t* __restrict__ index,
                                const float* __restrict__ scale, float* __restrict__ d, size_t rows, size_t classes,
                                bool scale_per_row) {
  const size_t n = rows * classes;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t row = i / classes, col = i % classes;
    int64_t hot = index[row];
    if (hot < 0) hot += (int64_t)classes;
    const float on = hot == (int64_t)col ? 1.0f : 0.0f;
    d[i] = __fmul_rn(__fsub_rn(expf(log_prob[i]), on), scale[scale_per_row ? row : 0]);
  }
}

}  // namespace

extern "C" int mpg_relu_grad_cuda(int type, const void* dy, const void* x, void* dx, size_t n, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16)
    relu_grad_kernel<<<blocks_for(n), 256, 0, s>>>(static_cast<const __nv_bfloat16*>(dy), static_cast<const __nv_bfloat16*>(x),
                                                   static_cast<__nv_bfloat16*>(dx), n);
  else if (type == kTypeFloat16)
    relu_grad_kernel<<<blocks_for(n), 256, 0, s>>>(static_cast<const __half*>(dy), static_cast<const __half*>(x),
                                                   static_cast<__half*>(dx), n);
  else
    relu_grad_kernel<<<blocks_for(n), 256, 0, s>>>(static_cast<const float*>(dy), static_cast<const float*>(x),
                                                   static_cast<float*>(dx), n);
  return (int)cudaGetLastError();
}

extern "C" int mpg_sce_grad_cuda(const float* log_prob, const int64_t* index, const float* scale, float* d, size_t rows,
                                 size_t classes, bool scale_per_row, void* stream) {
  sce_grad_kernel<<<blocks_for(rows * classes), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      log_prob, index, scale, d, rows, classes, scale_per_row);
  return (int)cudaGetLastError();
}

namespace {

// Adam's bias-corrected scalars in float64, one thread: step_size = float(lr / (one - b1^t)),
// bc2_sqrt = float(sqrt(one - b2^t)), as the ONNX ops compute them (Cast, Pow, Sub, Div, Sqrt).
__global__ void adam_scalars_kernel(const float* t, const float* lr, const double* b1, const double* b2,
                                    const double* one, float* step_size, float* bc2_sqrt) {
  const double t64 = (double)*t;
  const double bc1 = __dsub_rn(*one, pow(*b1, t64));
  const double bc2 = __dsub_rn(*one, pow(*b2, t64));
  *step_size = __double2float_rn(__ddiv_rn((double)*lr, bc1));
  *bc2_sqrt = __double2float_rn(__dsqrt_rn(bc2));
}

}  // namespace

extern "C" int mpg_adam_scalars_cuda(const float* t, const float* lr, const double* b1, const double* b2,
                                     const double* one, float* step_size, float* bc2_sqrt, void* stream) {
  adam_scalars_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(t, lr, b1, b2, one, step_size, bc2_sqrt);
  return (int)cudaGetLastError();
}
