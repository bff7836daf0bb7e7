// The CUDA side of SwiGluGrad (see kernels.cc): the backward of y = (a * s) * b with s =
// Sigmoid(a) (SiLU's gate times the up projection), one pass over dy, a, b and s writing da and
// db, where the gradient rules' ops take seven kernels and the summation of a's two
// contributions three more (two Casts to float32 and a Sum). Every step rounds to T as the
// ops' outputs do, with the ops' operands in the ops' order and no contraction into fused
// multiply-adds (__fmul_rn and friends), so each element is what the ops make; a's two
// contributions are added in float32 and rounded to T once, as Cast(Sum(float32, float32)).
// SwiGlu is the forward, y = (a * s) * b with s = Sigmoid(a) (also an output: the backward reads
// it), s computed as ORT's CUDA Sigmoid writes it (a > 0 ? 1 / (1 + exp(-|a|)) : 1 - that, each
// step in T).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>

#include "cuda_util.h"
#include "multi.h"

namespace {

template <typename T>
__device__ __forceinline__ void swiglu_grad_one(float dy, float a, float b, float s, T* da, T* db) {
  const float h = r<T>(__fmul_rn(a, s));                          // the forward's a * s
  *db = from_f<T>(__fmul_rn(dy, h));                              // Mul(dy, h)
  const float dh = r<T>(__fmul_rn(dy, b));                        // Mul(dy, b)
  const float c1 = r<T>(__fmul_rn(dh, s));                        // Mul(dh, s): a's first part
  const float ds = r<T>(__fmul_rn(dh, a));                        // Mul(dh, a)
  const float v = r<T>(__fmul_rn(s, r<T>(__fsub_rn(1.0f, s))));   // Mul(s, Sub(1, s))
  const float c2 = r<T>(__fmul_rn(ds, v));                        // Sigmoid's part of a
  *da = from_f<T>(__fadd_rn(c1, c2));
}

template <typename T>
__global__ void swiglu_grad_kernel(const T* __restrict__ dy, const T* __restrict__ a, const T* __restrict__ b,
                                   const T* __restrict__ s, T* __restrict__ da, T* __restrict__ db, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    swiglu_grad_one<T>(to_f(dy[i]), to_f(a[i]), to_f(b[i]), to_f(s[i]), da + i, db + i);
}

// Eight 2-byte elements per 16-byte load and store (float16, bfloat16 with n % 8 == 0 and
// 16-byte aligned tensors, as ORT's allocations are).
template <typename T>
__global__ void swiglu_grad_vec8(const uint4* __restrict__ dy, const uint4* __restrict__ a, const uint4* __restrict__ b,
                                 const uint4* __restrict__ s, uint4* __restrict__ da, uint4* __restrict__ db, size_t n8) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 vdy = dy[i], va = a[i], vb = b[i], vs = s[i];
    const T* pdy = reinterpret_cast<const T*>(&vdy);
    const T* pa = reinterpret_cast<const T*>(&va);
    const T* pb = reinterpret_cast<const T*>(&vb);
    const T* ps = reinterpret_cast<const T*>(&vs);
    uint4 vda, vdb;
    T* pda = reinterpret_cast<T*>(&vda);
    T* pdb = reinterpret_cast<T*>(&vdb);
#pragma unroll
    for (int k = 0; k < 8; ++k) swiglu_grad_one<T>(to_f(pdy[k]), to_f(pa[k]), to_f(pb[k]), to_f(ps[k]), pda + k, pdb + k);
    da[i] = vda;
    db[i] = vdb;
  }
}

template <typename T>
__device__ __forceinline__ void swiglu_one(float a, float b, T* y, T* s) {
  const float e = r<T>(expf(-fabsf(a)));
  const float q = r<T>(__fdiv_rn(1.0f, r<T>(__fadd_rn(1.0f, e))));
  const float sig = a > 0.0f ? q : r<T>(__fsub_rn(1.0f, q));
  *s = from_f<T>(sig);
  *y = from_f<T>(__fmul_rn(r<T>(__fmul_rn(a, sig)), b));
}

template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y, T* __restrict__ s,
                              size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    swiglu_one<T>(to_f(a[i]), to_f(b[i]), y + i, s + i);
}

template <typename T>
__global__ void swiglu_vec8(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* __restrict__ y,
                            uint4* __restrict__ s, size_t n8) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 va = a[i], vb = b[i];
    const T* pa = reinterpret_cast<const T*>(&va);
    const T* pb = reinterpret_cast<const T*>(&vb);
    uint4 vy, vs;
    T* py = reinterpret_cast<T*>(&vy);
    T* ps = reinterpret_cast<T*>(&vs);
#pragma unroll
    for (int k = 0; k < 8; ++k) swiglu_one<T>(to_f(pa[k]), to_f(pb[k]), py + k, ps + k);
    y[i] = vy;
    s[i] = vs;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<size_t>(p) & 15) == 0; }

unsigned blocks_for(size_t n, int threads) {
  const size_t want = (n + threads - 1) / threads;
  return (unsigned)(want < 132 * 32 ? (want ? want : 1) : 132 * 32);
}

template <typename T>
int launch(const void* dy, const void* a, const void* b, const void* s, void* da, void* db, size_t n, cudaStream_t st) {
  constexpr int threads = 256;
  if (sizeof(T) == 2 && n % 8 == 0 && aligned16(dy) && aligned16(a) && aligned16(b) && aligned16(s) && aligned16(da) &&
      aligned16(db)) {
    const size_t n8 = n / 8;
    swiglu_grad_vec8<T><<<blocks_for(n8, threads), threads, 0, st>>>(
        static_cast<const uint4*>(dy), static_cast<const uint4*>(a), static_cast<const uint4*>(b),
        static_cast<const uint4*>(s), static_cast<uint4*>(da), static_cast<uint4*>(db), n8);
  } else {
    swiglu_grad_kernel<T><<<blocks_for(n, threads), threads, 0, st>>>(
        static_cast<const T*>(dy), static_cast<const T*>(a), static_cast<const T*>(b), static_cast<const T*>(s),
        static_cast<T*>(da), static_cast<T*>(db), n);
  }
  return (int)cudaGetLastError();
}

template <typename T>
int launch_forward(const void* a, const void* b, void* y, void* s, size_t n, cudaStream_t st) {
  constexpr int threads = 256;
  if (sizeof(T) == 2 && n % 8 == 0 && aligned16(a) && aligned16(b) && aligned16(y) && aligned16(s)) {
    const size_t n8 = n / 8;
    swiglu_vec8<T><<<blocks_for(n8, threads), threads, 0, st>>>(static_cast<const uint4*>(a), static_cast<const uint4*>(b),
                                                                static_cast<uint4*>(y), static_cast<uint4*>(s), n8);
  } else {
    swiglu_kernel<T><<<blocks_for(n, threads), threads, 0, st>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                                 static_cast<T*>(y), static_cast<T*>(s), n);
  }
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int mpg_swiglu_cuda(int type, const void* a, const void* b, void* y, void* s, size_t n, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16) return launch_forward<__nv_bfloat16>(a, b, y, s, n, st);
  if (type == kTypeFloat16) return launch_forward<__half>(a, b, y, s, n, st);
  return launch_forward<float>(a, b, y, s, n, st);
}

extern "C" int mpg_swiglu_grad_cuda(int type, const void* dy, const void* a, const void* b, const void* s, void* da,
                                    void* db, size_t n, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16) return launch<__nv_bfloat16>(dy, a, b, s, da, db, n, st);
  if (type == kTypeFloat16) return launch<__half>(dy, a, b, s, da, db, n, st);
  return launch<float>(dy, a, b, s, da, db, n, st);
}
