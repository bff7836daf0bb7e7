// The CUDA side of RmsNormGrad (see kernels.cc): the backward of RMSNormalization over the last
// axis, recomputing r = 1 / sqrt(mean(x^2) + eps) per row. dscale = sum over rows of dy * (x * r)
// is summed in two stages through the op's workspace (a partial row per 32-row chunk, then their
// sum in order): fixed orders, no atomics, the same bits on every run. Statistics are float32
// whatever T is; each element step is rounded to T as the gradient rule's ops do. dy arrives as
// the parts the graph summed into it (float32, float16 or bfloat16 each: the Casts to float32
// before that Sum happen on load, exactly), added in their order as ORT's Sum does.
//
// Float32 x with a row of at most 768 columns, a multiple of 8, 16-byte aligned tensors (a
// Llama-style 125M: [8192, 768], dy two or three bfloat16 parts, dx added to the float32 residual
// gradient) takes one pass: a warp per row holds the row in registers (8 columns a lane per
// 256-column chunk, 16-byte loads, all of a row's issued before any is used), makes r, the row
// mean and dx, and adds dy * xhat into its own shared row of dscale sums over its rows; the
// block's 8 warps (32 rows) are then added in order into the chunk's partial row. Each byte is read once: the old path below (three passes over a row by a
// block, then a column kernel reading x and dy again) moved twice the traffic and measured
// 82 + 48 us a call on an H200. Other shapes take that path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "cuda_util.h"
#include "multi.h"

namespace {

struct DyParts {
  const void* p[4];
  int type[4];
  int n;
};

constexpr int kRowThreads = 256;

__device__ __forceinline__ float load_one(const void* p, int type, size_t i) {
  if (type == kTypeBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (type == kTypeFloat16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// dy[i]: its parts widened to float32 and added left to right (p0 + p1 + p2 ...).
__device__ __forceinline__ float load_dy(const DyParts& d, size_t i) {
  float v = load_one(d.p[0], d.type[0], i);
  for (int k = 1; k < d.n; ++k) v = __fadd_rn(v, load_one(d.p[k], d.type[k], i));
  return v;
}
constexpr int kColTile = 32, kRowLanes = 8, kChunkRows = 32;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// The block's sum of v (every thread gets it); part holds one float per warp.
__device__ float block_sum(float v, float* part) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // part may still be read by the previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += part[w];
  return total;
}

template <typename T>
__global__ void rmsnorm_dx_kernel(const DyParts dy, const T* __restrict__ x, const T* __restrict__ scale,
                                  const float* __restrict__ epsilon, const T* __restrict__ addend, T* __restrict__ dx,
                                  float* __restrict__ rstd, size_t cols) {
  __shared__ float part[kRowThreads / 32];
  const size_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const size_t base = row * cols;
  float sq = 0.0f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = to_f(xr[j]);
    sq += v * v;
  }
  const float ms = block_sum(sq, part) / (float)cols, eps = *epsilon;
  const float rs = r<T>(1.0f / sqrtf(r<T>(ms + eps)));
  float acc = 0.0f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = r<T>(to_f(xr[j]) * rs);
    const float dxhat = r<T>(load_dy(dy, base + j) * to_f(scale[j]));
    acc += r<T>(dxhat * xhat);
  }
  const float m = r<T>(block_sum(acc, part) / (float)cols);
  T* dxr = dx + row * cols;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = r<T>(to_f(xr[j]) * rs);
    const float dxhat = r<T>(load_dy(dy, base + j) * to_f(scale[j]));
    const float v = rs * r<T>(dxhat - r<T>(xhat * m));
    dxr[j] = from_f<T>(addend ? __fadd_rn(r<T>(v), to_f(addend[base + j])) : v);
  }
  if (threadIdx.x == 0) rstd[row] = rs;
}

// Block (x, y) sums dy * (x * r) over columns [32x, 32x + 32) and rows [y * 32, y * 32 + 32).
template <typename T>
__global__ void rmsnorm_dscale_partial(const DyParts dy, const T* __restrict__ x, const float* __restrict__ rstd,
                                       float* __restrict__ partial, size_t rows, size_t cols) {
  const size_t col = (size_t)blockIdx.x * kColTile + threadIdx.x;
  const size_t begin = (size_t)blockIdx.y * kChunkRows;
  const size_t end = begin + kChunkRows < rows ? begin + kChunkRows : rows;
  float acc = 0.0f;
  if (col < cols)
    for (size_t row = begin + threadIdx.y; row < end; row += kRowLanes) {
      const float xhat = r<T>(to_f(x[row * cols + col]) * rstd[row]);
      acc += r<T>(load_dy(dy, row * cols + col) * xhat);
    }
  __shared__ float part[kRowLanes][kColTile + 1];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float sum = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) sum += part[k][threadIdx.x];
    partial[(size_t)blockIdx.y * cols + col] = sum;
  }
}

// The one-pass path: kFusedWarps warps a block, kChunkRows rows a block, kVec columns a lane per
// 256-column chunk.
// At most 3 chunks (768 columns): 4 spill registers at 2 blocks an SM (128 registers a thread).
constexpr int kFusedWarps = 8, kVec = 8, kFusedMaxChunks = 3;

__device__ __forceinline__ float warp_all_sum(float v) {  // every lane gets the same sum
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Elements [i, i + 8) of a float32, float16 or bfloat16 tensor widened to float (exactly); any
// other type is read as float32, as load_one does.
__device__ __forceinline__ void load8(const void* p, int type, size_t i, float* v) {
  if (type != kTypeBFloat16 && type != kTypeFloat16) {
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(p) + i);
  const unsigned w[4] = {u.x, u.y, u.z, u.w};  // element 2k in the low half of w[k]
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (type == kTypeBFloat16) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      v[2 * k] = __half2float(__ushort_as_half((unsigned short)(w[k] & 0xffffu)));
      v[2 * k + 1] = __half2float(__ushort_as_half((unsigned short)(w[k] >> 16)));
    }
  }
}

__device__ __forceinline__ void store8(float* p, const float* v) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Eight 16-bit elements (one 16-byte load) widened to float (exactly): bfloat16 or float16.
__device__ __forceinline__ void widen8(uint4 u, bool bf16, float* v) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};  // element 2k in the low half of w[k]
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float bl = __uint_as_float(w[k] << 16), bh = __uint_as_float(w[k] & 0xffff0000u);
    const float hl = __half2float(__ushort_as_half((unsigned short)(w[k] & 0xffffu)));
    const float hh = __half2float(__ushort_as_half((unsigned short)(w[k] >> 16)));
    v[2 * k] = bf16 ? bl : hl;
    v[2 * k + 1] = bf16 ? bh : hh;
  }
}

// Block b: rows [32b, 32b + 32), warp w taking rows 32b + w, 32b + w + 8, ...; lane l the columns
// 8 (32c + l) .. + 8 of chunk c. dx as rmsnorm_dx_kernel<float> makes it (other sum orders), r per
// row, and the block's dscale sums over its rows (each warp's in its own shared row, the warps
// then added in order) into partial row b. A row's loads are all issued before any is used (a
// load waited for before the next is issued would leave too few bytes in flight to reach the
// bandwidth): kNarrow (every part of dy bfloat16 or float16) keeps each part's raw 16 bytes
// until all are in, the other case widens and adds part by part.
template <int kChunks, int kParts, bool kNarrow>
__global__ void __launch_bounds__(kFusedWarps * 32, 2)
rmsnorm_grad_fused(const DyParts dy, const float* __restrict__ x, const float* __restrict__ scale,
                   const float* __restrict__ epsilon, const float* __restrict__ addend, float* __restrict__ dx,
                   float* __restrict__ rstd, float* __restrict__ partial, size_t rows, int cols) {
  extern __shared__ float sums[];  // [kFusedWarps][cols]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, vecs = cols / kVec;
  const float eps = *epsilon;
  float* mine = sums + warp * cols;  // this warp's dscale sums; a lane only touches its columns
  const float zeros[kVec] = {};
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
    if (c * 32 + lane < vecs) store8(mine + (c * 32 + lane) * kVec, zeros);
  for (int i = 0; i < kChunkRows / kFusedWarps; ++i) {
    const size_t row = (size_t)blockIdx.x * kChunkRows + (size_t)i * kFusedWarps + warp;
    if (row >= rows) break;  // the same for the whole warp
    const size_t base = row * (size_t)cols;
    float xv[kChunks][kVec], g[kChunks][kVec], add[kChunks][kVec];
    uint4 raw[kChunks][kParts];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int v = c * 32 + lane;
      if (v >= vecs) continue;
      const size_t at = base + (size_t)v * kVec;
      load8(x, kTypeFloat, at, xv[c]);
      if (addend) load8(addend, kTypeFloat, at, add[c]);
      if constexpr (kNarrow) {
#pragma unroll
        for (int p = 0; p < kParts; ++p) raw[c][p] = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(dy.p[p]) + at);
      }
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int v = c * 32 + lane;
      if (v >= vecs) continue;
      const size_t at = base + (size_t)v * kVec;
      if constexpr (kNarrow) widen8(raw[c][0], dy.type[0] == kTypeBFloat16, g[c]);
      else load8(dy.p[0], dy.type[0], at, g[c]);
#pragma unroll
      for (int p = 1; p < kParts; ++p) {
        float part[kVec];
        if constexpr (kNarrow) widen8(raw[c][p], dy.type[p] == kTypeBFloat16, part);
        else load8(dy.p[p], dy.type[p], at, part);
#pragma unroll
        for (int k = 0; k < kVec; ++k) g[c][k] = __fadd_rn(g[c][k], part[k]);
      }
    }
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      if (c * 32 + lane < vecs)
#pragma unroll
        for (int k = 0; k < kVec; ++k) sq += xv[c][k] * xv[c][k];
    const float rs = 1.0f / sqrtf(warp_all_sum(sq) / (float)cols + eps);
    float acc = 0.0f;  // xv becomes xhat, g becomes dxhat once dscale has dy * xhat
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int v = c * 32 + lane;
      if (v >= vecs) continue;
      float sc[kVec], ds[kVec];
      load8(scale, kTypeFloat, (size_t)v * kVec, sc);
      load8(mine, kTypeFloat, (size_t)v * kVec, ds);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        xv[c][k] = xv[c][k] * rs;
        ds[k] += g[c][k] * xv[c][k];
        g[c][k] = g[c][k] * sc[k];
        acc += g[c][k] * xv[c][k];
      }
      store8(mine + v * kVec, ds);
    }
    const float m = warp_all_sum(acc) / (float)cols;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int v = c * 32 + lane;
      if (v >= vecs) continue;
      float out[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        out[k] = rs * (g[c][k] - xv[c][k] * m);
        if (addend) out[k] = __fadd_rn(out[k], add[c][k]);
      }
      store8(dx + base + (size_t)v * kVec, out);
    }
    if (lane == 0) rstd[row] = rs;
  }
  __syncthreads();
  for (int col = threadIdx.x; col < cols; col += blockDim.x) {
    float total = 0.0f;
    for (int w = 0; w < kFusedWarps; ++w) total += sums[w * cols + col];
    partial[(size_t)blockIdx.x * cols + col] = total;
  }
}

// dscale[col] = the sum of the chunks' partial rows: lane row y adds chunks y, y + 8, ..., then
// the 8 lane rows are added in order.
template <typename T>
__global__ void rmsnorm_dscale_total(const float* __restrict__ partial, T* __restrict__ dscale, size_t chunks,
                                     size_t cols) {
  const size_t col = (size_t)blockIdx.x * kColTile + threadIdx.x;
  float sum = 0.0f;
  if (col < cols)
    for (size_t k = threadIdx.y; k < chunks; k += kRowLanes) sum += partial[k * cols + col];
  __shared__ float part[kRowLanes][kColTile + 1];
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) total += part[k][threadIdx.x];
    dscale[col] = from_f<T>(total);
  }
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The one-pass path where it applies (see the top of the file); false where it does not.
template <int kChunks, bool kNarrow>
void launch_fused_kernel(const DyParts& dy, const float* x, const float* scale, const float* eps, const float* addend,
                         float* dx, float* rstd, float* partial, size_t rows, size_t cols, cudaStream_t s) {
  const unsigned blocks = (unsigned)((rows + kChunkRows - 1) / kChunkRows);
  const size_t shared = (size_t)kFusedWarps * cols * sizeof(float);
  const int n = (int)cols, threads = kFusedWarps * 32;
  switch (dy.n) {
    case 1: rmsnorm_grad_fused<kChunks, 1, kNarrow><<<blocks, threads, shared, s>>>(dy, x, scale, eps, addend, dx, rstd, partial, rows, n); break;
    case 2: rmsnorm_grad_fused<kChunks, 2, kNarrow><<<blocks, threads, shared, s>>>(dy, x, scale, eps, addend, dx, rstd, partial, rows, n); break;
    case 3: rmsnorm_grad_fused<kChunks, 3, kNarrow><<<blocks, threads, shared, s>>>(dy, x, scale, eps, addend, dx, rstd, partial, rows, n); break;
    default: rmsnorm_grad_fused<kChunks, 4, kNarrow><<<blocks, threads, shared, s>>>(dy, x, scale, eps, addend, dx, rstd, partial, rows, n);
  }
}

// The one-pass path where it applies (see the top of the file); false where it does not.
template <int kChunks>
bool launch_fused_chunks(const DyParts& dy, const float* x, const float* scale, const float* eps, const float* addend,
                         float* dx, float* rstd, float* partial, size_t rows, size_t cols, cudaStream_t s) {
  bool narrow = true;
  for (int k = 0; k < dy.n; ++k) narrow = narrow && (dy.type[k] == kTypeBFloat16 || dy.type[k] == kTypeFloat16);
  if (narrow) launch_fused_kernel<kChunks, true>(dy, x, scale, eps, addend, dx, rstd, partial, rows, cols, s);
  else launch_fused_kernel<kChunks, false>(dy, x, scale, eps, addend, dx, rstd, partial, rows, cols, s);
  return true;
}

template <typename T>
bool launch_fused(const DyParts& dy, const T* x, const T* scale, const float* eps, const T* addend, T* dx, float* rstd,
                  float* partial, size_t rows, size_t cols, cudaStream_t s) {
  if constexpr (!std::is_same<T, float>::value) {
    return false;
  } else {
#ifdef MPG_RMSNORM_THREE_PASS  // benchmarks/llama_kernels_torch.py builds the old path this way to time both
    return false;
#endif
    if (cols % kVec != 0 || cols > (size_t)kFusedMaxChunks * 32 * kVec) return false;
    if (!aligned16(x) || !aligned16(scale) || !aligned16(addend) || !aligned16(dx)) return false;
    for (int k = 0; k < dy.n; ++k)
      if (!aligned16(dy.p[k])) return false;
    switch ((cols / kVec + 31) / 32) {
      case 1: return launch_fused_chunks<1>(dy, x, scale, eps, addend, dx, rstd, partial, rows, cols, s);
      case 2: return launch_fused_chunks<2>(dy, x, scale, eps, addend, dx, rstd, partial, rows, cols, s);
      default: return launch_fused_chunks<3>(dy, x, scale, eps, addend, dx, rstd, partial, rows, cols, s);
    }
  }
}

template <typename T>
int launch(const DyParts& dy, const T* x, const T* scale, const float* eps, const T* addend, T* dx, T* dscale,
           float* work, size_t rows, size_t cols, cudaStream_t s) {
  if (rows == 0) return (int)cudaMemsetAsync(dscale, 0, cols * sizeof(T), s);  // no rows: dscale sums nothing
  float* rstd = work;
  float* partial = work + rows;
  const size_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  if (!launch_fused(dy, x, scale, eps, addend, dx, rstd, partial, rows, cols, s)) {
    const int threads = cols >= kRowThreads ? kRowThreads : (int)((cols + 31) / 32 * 32);
    rmsnorm_dx_kernel<T><<<(unsigned)rows, threads, 0, s>>>(dy, x, scale, eps, addend, dx, rstd, cols);
    const dim3 grid((unsigned)((cols + kColTile - 1) / kColTile), (unsigned)chunks), block(kColTile, kRowLanes);
    rmsnorm_dscale_partial<T><<<grid, block, 0, s>>>(dy, x, rstd, partial, rows, cols);
  }
  const dim3 block(kColTile, kRowLanes);
  rmsnorm_dscale_total<T><<<(unsigned)((cols + kColTile - 1) / kColTile), block, 0, s>>>(partial, dscale, chunks, cols);
  return (int)cudaGetLastError();
}

}  // namespace

// Floats the workspace holds: r per row, then one partial row of dscale per 32-row chunk.
extern "C" size_t mpg_rmsnorm_grad_workspace(size_t rows, size_t cols) {
  return rows + (rows + kChunkRows - 1) / kChunkRows * cols;
}

// x, scale, dx and dscale of one element type (float32, float16 or bfloat16); dy: 1 to 4 parts of
// x's size, each float32, float16 or bfloat16 (types: ONNX element types); eps: a float32 on the
// device; addend (x's type and size, or null): added to dx, as the Sum that read dx did.
extern "C" int mpg_rmsnorm_grad_cuda(int type, int parts, const void* const* dy, const int* dy_types, const void* x,
                                     const void* scale, const float* eps, const void* addend, void* dx, void* dscale,
                                     float* work, size_t rows, size_t cols, void* stream) {
  if (parts < 1 || parts > 4) return (int)cudaErrorInvalidValue;
  DyParts d{};
  d.n = parts;
  for (int k = 0; k < parts; ++k) {
    d.p[k] = dy[k];
    d.type[k] = dy_types[k];
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16) {
    using T = __nv_bfloat16;
    return launch(d, static_cast<const T*>(x), static_cast<const T*>(scale), eps,
                  static_cast<const T*>(addend), static_cast<T*>(dx), static_cast<T*>(dscale), work, rows, cols, s);
  }
  if (type == kTypeFloat16) {
    using T = __half;
    return launch(d, static_cast<const T*>(x), static_cast<const T*>(scale), eps,
                  static_cast<const T*>(addend), static_cast<T*>(dx), static_cast<T*>(dscale), work, rows, cols, s);
  }
  return launch(d, static_cast<const float*>(x), static_cast<const float*>(scale), eps,
                static_cast<const float*>(addend), static_cast<float*>(dx), static_cast<float*>(dscale), work, rows, cols, s);
}
