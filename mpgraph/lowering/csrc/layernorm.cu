// The CUDA side of LayerNormGrad (see kernels.cc): one block per row for dx (both row means
// in one read of the row, then dx in a second read that hits the cache), and a column pass for
// dscale in two stages through the op's workspace output (partial sums of 32-row chunks, then
// their sum): fixed orders, no atomics, so every run gives the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>

#include "cuda_util.h"
#include "multi.h"

namespace {

// dy may be float16 or bfloat16 (the cast to float32 it had in the graph is done on load: to_f).

constexpr int kRowThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

template <typename D>
__global__ void layernorm_dx_kernel(const D* __restrict__ dy, const float* __restrict__ x,
                                    const float* __restrict__ scale, const float* __restrict__ mean,
                                    const float* __restrict__ inv_std, float* __restrict__ dx, size_t cols) {
  const size_t row = blockIdx.x;
  const D* dyr = dy + row * cols;
  const float* xr = x + row * cols;
  const float mu = mean[row], rs = inv_std[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = (xr[j] - mu) * rs;
    const float dxhat = to_f(dyr[j]) * scale[j];
    s1 += dxhat;
    s2 += dxhat * xhat;
  }
  __shared__ float part[2][kRowThreads / 32];
  __shared__ float total[2];
  s1 = warp_sum(s1);
  s2 = warp_sum(s2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    part[0][warp] = s1;
    part[1][warp] = s2;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float a = 0.0f, b = 0.0f;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) {
      a += part[0][w];
      b += part[1][w];
    }
    total[0] = a / (float)cols;
    total[1] = b / (float)cols;
  }
  __syncthreads();
  const float m1 = total[0], m2 = total[1];
  float* dxr = dx + row * cols;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = (xr[j] - mu) * rs;
    const float dxhat = to_f(dyr[j]) * scale[j];
    dxr[j] = rs * ((dxhat - m1) - xhat * m2);
  }
}

constexpr int kColTile = 32, kRowLanes = 8;

// Stage 1: block (x, y) sums columns [32x, 32x + 32) over rows [y * chunk, (y + 1) * chunk),
// eight rows at a time, into partial[y][col] (and dy alone into partial[chunks + y][col] when
// dbias is wanted). Stage 2 adds the partials of each column in order. Both orders are fixed:
// the result is the same on every run.
template <typename D>
__global__ void layernorm_dscale_partial(const D* __restrict__ dy, const float* __restrict__ x,
                                         const float* __restrict__ mean, const float* __restrict__ inv_std,
                                         float* __restrict__ partial, size_t rows, size_t cols, size_t chunk,
                                         bool bias) {
  const size_t col = (size_t)blockIdx.x * kColTile + threadIdx.x;
  const size_t begin = (size_t)blockIdx.y * chunk;
  const size_t end = begin + chunk < rows ? begin + chunk : rows;
  float acc = 0.0f, acc_bias = 0.0f;
  if (col < cols)
    for (size_t r = begin + threadIdx.y; r < end; r += kRowLanes) {
      const float d = to_f(dy[r * cols + col]);
      acc += d * ((x[r * cols + col] - mean[r]) * inv_std[r]);
      acc_bias += d;
    }
  __shared__ float part[2][kRowLanes][kColTile + 1];
  part[0][threadIdx.y][threadIdx.x] = acc;
  part[1][threadIdx.y][threadIdx.x] = acc_bias;
  __syncthreads();
  if (threadIdx.y < (bias ? 2 : 1) && col < cols) {
    float sum = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) sum += part[threadIdx.y][k][threadIdx.x];
    partial[((size_t)threadIdx.y * gridDim.y + blockIdx.y) * cols + col] = sum;
  }
}

__global__ void layernorm_dscale_total(const float* __restrict__ partial, float* __restrict__ dscale,
                                       float* __restrict__ dbias, size_t chunks, size_t cols) {
  const size_t col = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  for (size_t k = 0; k < chunks; ++k) sum += partial[k * cols + col];
  dscale[col] = sum;
  if (!dbias) return;
  sum = 0.0f;
  for (size_t k = 0; k < chunks; ++k) sum += partial[(chunks + k) * cols + col];
  dbias[col] = sum;
}

template <typename D>
int launch(const D* dy, const float* x, const float* scale, const float* mean, const float* inv_std, float* dx,
           float* dscale, float* dbias, float* partial, size_t rows, size_t cols, cudaStream_t s);

}  // namespace

extern "C" size_t mpg_layernorm_grad_chunks(size_t rows) { return (rows + 31) / 32; }

namespace {

template <typename D>
int launch(const D* dy, const float* x, const float* scale, const float* mean, const float* inv_std, float* dx,
           float* dscale, float* dbias, float* partial, size_t rows, size_t cols, cudaStream_t s) {
  const int threads = cols >= kRowThreads ? kRowThreads : (int)((cols + 31) / 32 * 32);
  layernorm_dx_kernel<D><<<(unsigned)rows, threads, 0, s>>>(dy, x, scale, mean, inv_std, dx, cols);
  const size_t chunks = mpg_layernorm_grad_chunks(rows);
  const dim3 grid((unsigned)((cols + kColTile - 1) / kColTile), (unsigned)chunks), block(kColTile, kRowLanes);
  layernorm_dscale_partial<D><<<grid, block, 0, s>>>(dy, x, mean, inv_std, partial, rows, cols, 32, dbias != nullptr);
  layernorm_dscale_total<<<(unsigned)((cols + 255) / 256), 256, 0, s>>>(partial, dscale, dbias, chunks, cols);
  return (int)cudaGetLastError();
}

}  // namespace

// ``dbias`` null: no bias gradient (the workspace holds ``chunks`` rows, else twice that).
extern "C" int mpg_layernorm_grad_cuda(int dy_type, const void* dy, const float* x, const float* scale,
                                       const float* mean, const float* inv_std, float* dx, float* dscale, float* dbias,
                                       float* partial, size_t rows, size_t cols, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dy_type == kTypeBFloat16)
    return launch(static_cast<const __nv_bfloat16*>(dy), x, scale, mean, inv_std, dx, dscale, dbias, partial, rows, cols, s);
  if (dy_type == kTypeFloat16)
    return launch(static_cast<const __half*>(dy), x, scale, mean, inv_std, dx, dscale, dbias, partial, rows, cols, s);
  return launch(static_cast<const float*>(dy), x, scale, mean, inv_std, dx, dscale, dbias, partial, rows, cols, s);
}
