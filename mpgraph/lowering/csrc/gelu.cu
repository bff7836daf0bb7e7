// The CUDA side of ErfGelu, ErfGeluGrad and TanhGeluGrad (see kernels.cc): the erf GELU's
// forward (5 ONNX ops) and backward (10 ops), and the tanh GELU's backward (16 ops), in one
// pass each. Every step rounds to the element type T as the
// separate ops' outputs do (each ORT elementwise kernel computes in float and stores T), so the
// results equal the ops they replace; the backward recomputes the forward's intermediates from
// x instead of reading them back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_util.h"
#include "multi.h"

namespace {

struct Consts {
  float div, one, half, k;
};

// The four T-typed scalars (device pointers; the backward's k may be absent in the forward).
template <typename T> struct ConstPtrs {
  const T* p[4];
};

template <typename T> __device__ __forceinline__ Consts load(const ConstPtrs<T>& cp) {
  return Consts{to_f(*cp.p[0]), to_f(*cp.p[1]), to_f(*cp.p[2]), cp.p[3] ? to_f(*cp.p[3]) : 0.0f};
}

// s = x / div; cdf = half * (erf(s) + one), each rounded to T.
template <typename T> __device__ __forceinline__ void forward(float x, const Consts& c, float* s, float* cdf) {
  *s = r<T>(__fdiv_rn(x, c.div));
  const float e = r<T>(erff(*s));
  *cdf = r<T>(__fmul_rn(c.half, r<T>(__fadd_rn(e, c.one))));
}

template <typename T>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ y, size_t n, ConstPtrs<T> cp) {
  const Consts c = load<T>(cp);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float xi = to_f(x[i]);
    float s, cdf;
    forward<T>(xi, c, &s, &cdf);
    y[i] = from_f<T>(__fmul_rn(xi, cdf));
  }
}

// dx = dy * (cdf + (s / exp(s * s)) * k), each rounded to T.
template <typename T>
__global__ void gelu_grad_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, size_t n,
                                 ConstPtrs<T> cp) {
  const Consts c = load<T>(cp);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float s, cdf;
    forward<T>(to_f(x[i]), c, &s, &cdf);
    const float ex = r<T>(expf(r<T>(__fmul_rn(s, s))));
    const float tail = r<T>(__fmul_rn(r<T>(__fdiv_rn(s, ex)), c.k));
    dx[i] = from_f<T>(__fmul_rn(to_f(dy[i]), r<T>(__fadd_rn(cdf, tail))));
  }
}

// TanhGeluGrad's five T-typed scalars: c = sqrt(2/pi), ck = c * 0.044715, ck3 = 3 * ck, one, half.
template <typename T> struct TanhConstPtrs {
  const T* p[5];
};

// The tanh GELU's backward as autodiff.rules.elementwise.gelu writes it, op by op, each rounded
// to T: x2 = x * x; t = tanh(x * (c + x2 * ck)); dinner = c + x2 * ck3;
// dx = dy * (half * (one + t) + (half * x) * ((one - t * t) * dinner)).
struct TanhConsts {
  float c, ck, ck3, one, half;
};

template <typename T> __device__ __forceinline__ TanhConsts load_tanh(const TanhConstPtrs<T>& cp) {
  return TanhConsts{to_f(*cp.p[0]), to_f(*cp.p[1]), to_f(*cp.p[2]), to_f(*cp.p[3]), to_f(*cp.p[4])};
}

template <typename T> __device__ __forceinline__ T tanh_gelu_grad_one(float dy, float xi, const TanhConsts& k) {
  const float x2 = r<T>(__fmul_rn(xi, xi));
  const float inner = r<T>(__fmul_rn(xi, r<T>(__fadd_rn(k.c, r<T>(__fmul_rn(x2, k.ck))))));
  const float t = r<T>(tanhf(inner));
  const float dinner = r<T>(__fadd_rn(k.c, r<T>(__fmul_rn(x2, k.ck3))));
  const float sech2 = r<T>(__fsub_rn(k.one, r<T>(__fmul_rn(t, t))));
  const float left = r<T>(__fmul_rn(k.half, r<T>(__fadd_rn(k.one, t))));
  const float right = r<T>(__fmul_rn(r<T>(__fmul_rn(k.half, xi)), r<T>(__fmul_rn(sech2, dinner))));
  return from_f<T>(__fmul_rn(dy, r<T>(__fadd_rn(left, right))));
}

template <typename T>
__global__ void tanh_gelu_grad_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, size_t n,
                                      TanhConstPtrs<T> cp) {
  const TanhConsts k = load_tanh<T>(cp);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dx[i] = tanh_gelu_grad_one<T>(to_f(dy[i]), to_f(x[i]), k);
}

// Eight 2-byte elements per 16-byte load and store (float16, bfloat16 with n % 8 == 0 and
// 16-byte aligned tensors, as ORT's allocations are): the same arithmetic per element, so the
// same bits as the scalar kernel. On the H200 the scalar kernel took 117 us per GPT-2 call
// ([8, 1024, 3072] bf16, 150 MB moved: 1.3 TB/s).
template <typename T>
__global__ void tanh_gelu_grad_vec8(const uint4* __restrict__ dy, const uint4* __restrict__ x, uint4* __restrict__ dx,
                                    size_t n8, TanhConstPtrs<T> cp) {
  const TanhConsts k = load_tanh<T>(cp);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 vdy = dy[i], vx = x[i];
    const T* pdy = reinterpret_cast<const T*>(&vdy);
    const T* px = reinterpret_cast<const T*>(&vx);
    uint4 vdx;
    T* pdx = reinterpret_cast<T*>(&vdx);
#pragma unroll
    for (int j = 0; j < 8; ++j) pdx[j] = tanh_gelu_grad_one<T>(to_f(pdy[j]), to_f(px[j]), k);
    dx[i] = vdx;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<size_t>(p) & 15) == 0; }

unsigned blocks_for(size_t n) {
  size_t b = (n + 255) / 256;
  if (b > 8192) b = 8192;
  return b ? (unsigned)b : 1u;
}

template <typename T>
int launch(const void* dy, const void* x, void* out, size_t n, const void* const* consts, cudaStream_t stream) {
  ConstPtrs<T> c;
  for (int i = 0; i < 4; ++i) c.p[i] = static_cast<const T*>(consts[i]);
  if (dy == nullptr)
    gelu_kernel<T><<<blocks_for(n), 256, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(out), n, c);
  else
    gelu_grad_kernel<T><<<blocks_for(n), 256, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                          static_cast<T*>(out), n, c);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_tanh(const void* dy, const void* x, void* dx, size_t n, const void* const* consts, cudaStream_t stream) {
  TanhConstPtrs<T> c;
  for (int i = 0; i < 5; ++i) c.p[i] = static_cast<const T*>(consts[i]);
  if (sizeof(T) == 2 && n % 8 == 0 && aligned16(dy) && aligned16(x) && aligned16(dx))
    tanh_gelu_grad_vec8<T><<<blocks_for(n / 8), 256, 0, stream>>>(
        static_cast<const uint4*>(dy), static_cast<const uint4*>(x), static_cast<uint4*>(dx), n / 8, c);
  else
    tanh_gelu_grad_kernel<T><<<blocks_for(n), 256, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                                static_cast<T*>(dx), n, c);
  return (int)cudaGetLastError();
}

}  // namespace

// ``dy`` null: the forward (out = y); else the backward (out = dx). ``consts``: device pointers
// to the T-typed scalars div, one, half and k (k null in the forward).
extern "C" int mpg_gelu_cuda(int type, const void* dy, const void* x, void* out, size_t n, const void* const* consts,
                             void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16) return launch<__nv_bfloat16>(dy, x, out, n, consts, s);
  if (type == kTypeFloat16) return launch<__half>(dy, x, out, n, consts, s);
  return launch<float>(dy, x, out, n, consts, s);
}

// TanhGeluGrad: dx from dy and x. ``consts``: device pointers to the T-typed scalars c, ck, ck3,
// one and half.
extern "C" int mpg_tanh_gelu_grad_cuda(int type, const void* dy, const void* x, void* dx, size_t n,
                                       const void* const* consts, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16) return launch_tanh<__nv_bfloat16>(dy, x, dx, n, consts, s);
  if (type == kTypeFloat16) return launch_tanh<__half>(dy, x, dx, n, consts, s);
  return launch_tanh<float>(dy, x, dx, n, consts, s);
}
