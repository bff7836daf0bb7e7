// The CUDA side of ai.mpgraph.RotaryEmbedding (see kernels.cc): ONNX's RotaryEmbedding (opset
// 23) as one bandwidth-bound pass. ORT's CUDA kernel (RotaryEmbeddingBSNH) runs one thread per
// element, one block per (s, b, n) row of 64 threads and does its arithmetic in T; at Llama's
// shapes ([8, 1024, H * 64] bfloat16) it takes ~41 us a call against a few us of traffic.
//
// Rows are the tensor's contiguous head_size blocks (3-D [B, S, N * H]: row (b, s, n); 4-D
// [B, N, S, H]: row (b, n, s)). Each thread takes 16 bytes of a row's rotated pairs: for the
// non-interleaved form the 16 bytes at i and those at i + rdim / 2, for the interleaved form 16
// consecutive bytes (pairs (2k, 2k + 1)), plus 16 bytes of cos and of sin (8 for interleaved);
// the tail of a row past rotary_embedding_dim is copied in 16-byte pieces. Where the sizes or
// pointers do not allow 16-byte pieces, one element a thread (the same arithmetic).
//
// The arithmetic is MLAS's (ORT CPU's AVX2 rope kernel) in float, one rounding to T per output:
//   out1 = fma(x1, cos, -(x2 * sin)),  out2 = fma(x1, sin, x2 * cos)
// (so float32 results are ORT CPU's bits; ORT CUDA's T arithmetic rounds each step in T).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_util.h"
#include "multi.h"
#include "rotary.h"

namespace {

__device__ __forceinline__ void rotate(float x1, float x2, float c, float s, float* y1, float* y2) {
  *y1 = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
  *y2 = __fmaf_rn(x1, s, __fmul_rn(x2, c));
}

// The cache row of row ``row``: (b * S + s) * half, s * half for [1, S, half] caches, or
// position_ids[b * S + s] * half. I is 32-bit where the tensor allows (64-bit division is a long
// instruction sequence on the GPU).
template <typename I>
__device__ __forceinline__ int64_t cache_row(const RotaryShape& p, I row, const int64_t* pos) {
  I bs;
  if (p.bnsh) {
    const I b = row / (I)(p.heads * p.seq), s = row % (I)p.seq;
    bs = b * (I)p.seq + s;
  } else {
    bs = row / (I)p.heads;
  }
  return (pos ? pos[bs] : p.cache_b1 ? (int64_t)(bs % (I)p.seq) : (int64_t)bs) * (p.rdim / 2);
}

// One element a thread: output element i of its row, as ORT's CUDA kernel indexes it.
template <typename T, typename I>
__global__ void rotary_scalar(const T* __restrict__ x, const T* __restrict__ cosc, const T* __restrict__ sinc,
                              const int64_t* __restrict__ pos, T* __restrict__ y, RotaryShape p, I n) {
  const int half = p.rdim / 2;
  const float sg = p.neg_sin ? -1.0f : 1.0f;  // exact: the Neg the gradient rule wrote
  for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
    const I row = e / (I)p.head;
    const int i = (int)(e % p.head);
    const T* xr = x + (int64_t)row * p.head;
    if (i >= p.rdim) {
      y[e] = xr[i];
      continue;
    }
    const int64_t off = cache_row(p, row, pos);
    int k, i1, i2;
    if (p.interleaved) {
      k = i / 2, i1 = 2 * k, i2 = i1 + 1;
    } else {
      k = i % half, i1 = k, i2 = k + half;
    }
    float y1, y2;
    rotate(to_f(xr[i1]), to_f(xr[i2]), to_f(cosc[off + k]), sg * to_f(sinc[off + k]), &y1, &y2);
    y[e] = from_f<T>(i == i1 ? y1 : y2);
  }
}

// Vector pieces: V elements (16 bytes) a piece. A row has ``rot`` rotation pieces then ``tail``
// copy pieces; non-interleaved, rotation piece j covers [j V, j V + V) and the same + half.
template <typename T, typename I>
__global__ void rotary_vec(const T* __restrict__ x, const T* __restrict__ cosc, const T* __restrict__ sinc,
                           const int64_t* __restrict__ pos, T* __restrict__ y, RotaryShape p, I rows) {
  constexpr int V = 16 / sizeof(T);
  const int half = p.rdim / 2;
  const int rot = p.interleaved ? p.rdim / V : half / V;
  const int per_row = rot + (p.head - p.rdim) / V;
  const float sg = p.neg_sin ? -1.0f : 1.0f;
  const I pieces = rows * (I)per_row;
  for (I t = (I)blockIdx.x * blockDim.x + threadIdx.x; t < pieces; t += (I)gridDim.x * blockDim.x) {
    const I row = t / (I)per_row;
    const int j = (int)(t % (I)per_row);
    const T* xr = x + (int64_t)row * p.head;
    T* yr = y + (int64_t)row * p.head;
    if (j >= rot) {
      const int at = p.rdim + (j - rot) * V;
      *reinterpret_cast<uint4*>(yr + at) = *reinterpret_cast<const uint4*>(xr + at);
      continue;
    }
    const int64_t off = cache_row(p, row, pos);
    if (!p.interleaved) {
      const int at = j * V;
      const uint4 va = *reinterpret_cast<const uint4*>(xr + at), vb = *reinterpret_cast<const uint4*>(xr + at + half);
      const uint4 vc = *reinterpret_cast<const uint4*>(cosc + off + at), vs = *reinterpret_cast<const uint4*>(sinc + off + at);
      const T *a = reinterpret_cast<const T*>(&va), *b = reinterpret_cast<const T*>(&vb);
      const T *c = reinterpret_cast<const T*>(&vc), *s = reinterpret_cast<const T*>(&vs);
      uint4 oa, ob;
      T *ya = reinterpret_cast<T*>(&oa), *yb = reinterpret_cast<T*>(&ob);
#pragma unroll
      for (int q = 0; q < V; ++q) {
        float y1, y2;
        rotate(to_f(a[q]), to_f(b[q]), to_f(c[q]), sg * to_f(s[q]), &y1, &y2);
        ya[q] = from_f<T>(y1);
        yb[q] = from_f<T>(y2);
      }
      *reinterpret_cast<uint4*>(yr + at) = oa;
      *reinterpret_cast<uint4*>(yr + at + half) = ob;
    } else {
      const int at = j * V;
      const uint4 va = *reinterpret_cast<const uint4*>(xr + at);
      const uint2 vc = *reinterpret_cast<const uint2*>(cosc + off + at / 2);
      const uint2 vs = *reinterpret_cast<const uint2*>(sinc + off + at / 2);
      const T* a = reinterpret_cast<const T*>(&va);
      const T *c = reinterpret_cast<const T*>(&vc), *s = reinterpret_cast<const T*>(&vs);
      uint4 o;
      T* yo = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int q = 0; q < V / 2; ++q) {
        float y1, y2;
        rotate(to_f(a[2 * q]), to_f(a[2 * q + 1]), to_f(c[q]), sg * to_f(s[q]), &y1, &y2);
        yo[2 * q] = from_f<T>(y1);
        yo[2 * q + 1] = from_f<T>(y2);
      }
      *reinterpret_cast<uint4*>(yr + at) = o;
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<size_t>(p) & 15) == 0; }

unsigned blocks_for(int64_t n, int threads) {
  const int64_t want = (n + threads - 1) / threads;
  return (unsigned)(want < 132 * 32 ? (want ? want : 1) : 132 * 32);
}

template <typename T, typename I>
int launch(const void* x, const void* c, const void* s, const int64_t* pos, void* y, const RotaryShape& p, int64_t rows,
           cudaStream_t st) {
  constexpr int threads = 256;
  constexpr int V = 16 / sizeof(T);
  const bool vec = p.head % V == 0 && p.rdim % (p.interleaved ? V : 2 * V) == 0 && aligned16(x) && aligned16(c) &&
                   aligned16(s) && aligned16(y);
  if (vec) {
    const int64_t per_row = (p.interleaved ? p.rdim / V : p.rdim / 2 / V) + (p.head - p.rdim) / V;
    rotary_vec<T, I><<<blocks_for(rows * per_row, threads), threads, 0, st>>>(
        static_cast<const T*>(x), static_cast<const T*>(c), static_cast<const T*>(s), pos, static_cast<T*>(y), p, (I)rows);
  } else {
    rotary_scalar<T, I><<<blocks_for(rows * p.head, threads), threads, 0, st>>>(
        static_cast<const T*>(x), static_cast<const T*>(c), static_cast<const T*>(s), pos, static_cast<T*>(y), p,
        (I)(rows * p.head));
  }
  return (int)cudaGetLastError();
}

template <typename T>
int launch_indexed(const void* x, const void* c, const void* s, const int64_t* pos, void* y, const RotaryShape& p,
                   int64_t rows, cudaStream_t st) {
  // Every index the kernels form (elements, pieces, rows, b * S + s) is below rows * head.
  if (rows * p.head < ((int64_t)1 << 31)) return launch<T, uint32_t>(x, c, s, pos, y, p, rows, st);
  return launch<T, int64_t>(x, c, s, pos, y, p, rows, st);
}

}  // namespace

extern "C" int mpg_rotary_cuda(int type, const void* x, const void* cos_cache, const void* sin_cache,
                               const int64_t* position_ids, void* y, RotaryShape shape, int64_t rows, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (rows == 0 || shape.head == 0) return 0;
  if (type == kTypeBFloat16) return launch_indexed<__nv_bfloat16>(x, cos_cache, sin_cache, position_ids, y, shape, rows, st);
  if (type == kTypeFloat16) return launch_indexed<__half>(x, cos_cache, sin_cache, position_ids, y, shape, rows, st);
  return launch_indexed<float>(x, cos_cache, sin_cache, position_ids, y, shape, rows, st);
}
