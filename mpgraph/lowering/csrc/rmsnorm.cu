// The CUDA side of RmsNormGrad (see kernels.cc): the backward of RMSNormalization over the last
// axis, recomputing r = 1 / sqrt(mean(x^2) + eps) per row. One block per row makes dx (three
// passes over the row: the sum of squares, then sum(dxhat * xhat) once r is known, then dx; the
// second and third hit the cache) and stores r; dscale = sum over rows of dy * (x * r) is a
// column pass in two stages through the op's workspace output (partials of 32-row chunks, then
// their sum in order): fixed orders, no atomics, the same bits on every run. Statistics are
// float32 whatever T is; each element step is rounded to T as the gradient rule's ops do. dy
// arrives as the parts the graph summed into it (float32, float16 or bfloat16 each: the Casts to
// float32 before that Sum happen on load, exactly), added in their order as ORT's Sum does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>

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

template <typename T>
__global__ void rmsnorm_dscale_total(const float* __restrict__ partial, T* __restrict__ dscale, size_t chunks,
                                     size_t cols) {
  const size_t col = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  for (size_t k = 0; k < chunks; ++k) sum += partial[k * cols + col];
  dscale[col] = from_f<T>(sum);
}

template <typename T>
int launch(const DyParts& dy, const T* x, const T* scale, const float* eps, const T* addend, T* dx, T* dscale,
           float* work, size_t rows, size_t cols, cudaStream_t s) {
  if (rows == 0) return (int)cudaMemsetAsync(dscale, 0, cols * sizeof(T), s);  // no rows: dscale sums nothing
  const int threads = cols >= kRowThreads ? kRowThreads : (int)((cols + 31) / 32 * 32);
  float* rstd = work;
  float* partial = work + rows;
  rmsnorm_dx_kernel<T><<<(unsigned)rows, threads, 0, s>>>(dy, x, scale, eps, addend, dx, rstd, cols);
  const size_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  const dim3 grid((unsigned)((cols + kColTile - 1) / kColTile), (unsigned)chunks), block(kColTile, kRowLanes);
  rmsnorm_dscale_partial<T><<<grid, block, 0, s>>>(dy, x, rstd, partial, rows, cols);
  rmsnorm_dscale_total<T><<<(unsigned)((cols + 255) / 256), 256, 0, s>>>(partial, dscale, chunks, cols);
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
