// The CUDA side of SoftmaxCrossEntropyRows and SoftmaxCrossEntropyRowsGrad (see kernels.cc):
// one block per row of the low-precision logits ([rows, cols], the last cols - valid columns
// padding), read with 16-byte loads (8 bfloat16/float16 or 4 float32) where the row allows it.
// Statistics are float32: per thread an online max and sum of exp, merged across the warp with
// shuffles and across the block through shared memory. The terms are the unfused ops' own:
// log_prob = (x - max) - log(sum), d = (exp(log_prob) - onehot) * scale, rounded to T once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_util.h"
#include "multi.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLossThreads = 1024;
enum { kMean = 0, kSum = 1, kNone = 2 };  // the ``reduction`` attribute

struct MaxSum {
  float m, s;  // the running max, and sum of exp(x - m)
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, __fadd_rn(__fmul_rn(a.s, expf(__fsub_rn(a.m, m))), __fmul_rn(b.s, expf(__fsub_rn(b.m, m))))};
}

// Adds n values to a thread's running (max, sum).
template <int n>
__device__ __forceinline__ void add(MaxSum& acc, const float (&v)[n]) {
  float top = v[0];
#pragma unroll
  for (int i = 1; i < n; ++i) top = fmaxf(top, v[i]);
  if (top > acc.m) {
    acc.s = __fmul_rn(acc.s, expf(__fsub_rn(acc.m, top)));
    acc.m = top;
  }
  if (acc.m == -INFINITY) return;  // all -inf so far: nothing to add
#pragma unroll
  for (int i = 0; i < n; ++i) acc.s = __fadd_rn(acc.s, expf(__fsub_rn(v[i], acc.m)));
}

template <typename T>
struct Vec {
  static constexpr int n = 16 / sizeof(T);
  __device__ __forceinline__ static void load(const T* p, float (&v)[n]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < n; ++i) v[i] = to_f(e[i]);
  }
  __device__ __forceinline__ static void store(T* p, const float (&v)[n]) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < n; ++i) e[i] = from_f<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

__device__ MaxSum block_merge(MaxSum acc) {
  __shared__ float ms[kWarps], ss[kWarps];
  for (int offset = 16; offset > 0; offset >>= 1)
    acc = merge(acc, {__shfl_xor_sync(0xffffffffu, acc.m, offset), __shfl_xor_sync(0xffffffffu, acc.s, offset)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    ms[warp] = acc.m;
    ss[warp] = acc.s;
  }
  __syncthreads();
  acc = {-INFINITY, 0.0f};
  if (warp == 0) {
    if (lane < kWarps) acc = {ms[lane], ss[lane]};
    for (int offset = kWarps / 2; offset > 0; offset >>= 1)
      acc = merge(acc, {__shfl_xor_sync(0xffffffffu, acc.m, offset), __shfl_xor_sync(0xffffffffu, acc.s, offset)});
  }
  return acc;  // thread 0 holds the row's
}

// stats[row] = (max, log(sum exp(x - max))) over the row's first ``valid`` columns.
template <typename T, bool vec>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(const T* __restrict__ logits, float2* __restrict__ stats,
                                                             size_t cols, size_t valid) {
  const T* x = logits + (size_t)blockIdx.x * cols;
  MaxSum acc{-INFINITY, 0.0f};
  size_t done = 0;
  if (vec) {
    constexpr int n = Vec<T>::n;
    const size_t chunks = valid / n;
    for (size_t c = threadIdx.x; c < chunks; c += kThreads) {
      float v[n];
      Vec<T>::load(x + c * n, v);
      add<n>(acc, v);
    }
    done = chunks * n;
  }
  for (size_t j = done + threadIdx.x; j < valid; j += kThreads) {
    const float v[1] = {to_f(x[j])};
    add<1>(acc, v);
  }
  acc = block_merge(acc);
  if (threadIdx.x == 0) stats[blockIdx.x] = make_float2(acc.m, logf(acc.s));
}

// The loss from the rows' statistics and the label logits (one block): -log_prob[label] per
// kept row, summed (mean: divided by the kept rows' count) or written per row (none).
template <typename T>
__global__ void __launch_bounds__(kLossThreads) loss_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                                                            const float2* __restrict__ stats, float* __restrict__ loss,
                                                            float* __restrict__ count, size_t rows, size_t cols,
                                                            size_t valid, int64_t ignore, bool has_ignore, int reduction) {
  __shared__ float sums[kLossThreads / 32], counts[kLossThreads / 32];
  float sum = 0.0f, kept = 0.0f;
  for (size_t r = threadIdx.x; r < rows; r += kLossThreads) {
    const int64_t label = labels[r];
    float term = 0.0f;
    if (!has_ignore || label != ignore) {
      const int64_t k = label < 0 ? label + (int64_t)valid : label;
      const float2 st = stats[r];
      term = k >= 0 && k < (int64_t)valid ? -__fsub_rn(__fsub_rn(to_f(logits[r * cols + k]), st.x), st.y) : NAN;
      sum = __fadd_rn(sum, term);
      kept = __fadd_rn(kept, 1.0f);
    }
    if (reduction == kNone) loss[r] = term;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
    kept = __fadd_rn(kept, __shfl_xor_sync(0xffffffffu, kept, offset));
  }
  if (threadIdx.x % 32 == 0) {
    sums[threadIdx.x / 32] = sum;
    counts[threadIdx.x / 32] = kept;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sum = kept = 0.0f;
    for (int w = 0; w < kLossThreads / 32; ++w) {
      sum = __fadd_rn(sum, sums[w]);
      kept = __fadd_rn(kept, counts[w]);
    }
    *count = kept;
    if (reduction == kMean) *loss = __fdiv_rn(sum, kept);
    if (reduction == kSum) *loss = sum;
  }
}

// d = (exp((x - max) - logsum) - onehot(index)) * scale over the valid columns, zero in the
// padding; scale and index as the SoftmaxCrossEntropyLoss rule makes them: Where(kept, label, 0),
// dloss / count (mean), dloss (sum) or dloss[row] (none), times Cast(kept) with an ignore_index.
// dx may be logits (ORT gives dx the logits' buffer, kernels.cc): each thread reads an element,
// then writes it, and no element is read after it is written, so the two are not __restrict__.
template <typename T, bool vec>
__global__ void __launch_bounds__(kThreads) rows_grad_kernel(const T* logits, const int64_t* __restrict__ labels,
                                                             const float2* __restrict__ stats, const float* __restrict__ count,
                                                             const float* __restrict__ dloss, T* dx, size_t cols,
                                                             size_t valid, int64_t ignore, bool has_ignore, int reduction) {
  const size_t row = blockIdx.x;
  const int64_t label = labels[row];
  const bool kept = !has_ignore || label != ignore;
  int64_t hot = kept ? label : 0;
  if (hot < 0) hot += (int64_t)valid;
  float scale = reduction == kMean ? __fdiv_rn(dloss[0], count[0]) : dloss[reduction == kNone ? row : 0];
  if (has_ignore) scale = __fmul_rn(scale, kept ? 1.0f : 0.0f);
  const float2 st = stats[row];
  const T* x = logits + row * cols;
  T* d = dx + row * cols;
  size_t done = 0;
  if (vec) {
    constexpr int n = Vec<T>::n;
    const size_t chunks = cols / n;
    for (size_t c = threadIdx.x; c < chunks; c += kThreads) {
      float v[n];
      Vec<T>::load(x + c * n, v);
#pragma unroll
      for (int i = 0; i < n; ++i) {
        const size_t j = c * n + i;
        const float p = expf(__fsub_rn(__fsub_rn(v[i], st.x), st.y));
        v[i] = j < valid ? __fmul_rn(__fsub_rn(p, (int64_t)j == hot ? 1.0f : 0.0f), scale) : 0.0f;
      }
      Vec<T>::store(d + c * n, v);
    }
    done = chunks * n;
  }
  for (size_t j = done + threadIdx.x; j < cols; j += kThreads) {
    const float p = expf(__fsub_rn(__fsub_rn(to_f(x[j]), st.x), st.y));
    d[j] = from_f<T>(j < valid ? __fmul_rn(__fsub_rn(p, (int64_t)j == hot ? 1.0f : 0.0f), scale) : 0.0f);
  }
}

// 16-byte loads need every row to start 16-byte aligned.
template <typename T>
bool vectorizable(const void* a, const void* b, size_t cols) {
  return cols % Vec<T>::n == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

template <typename T>
int forward(const void* logits, const int64_t* labels, float* loss, float* stats, float* count, size_t rows, size_t cols,
            size_t valid, int64_t ignore, bool has_ignore, int reduction, cudaStream_t s) {
  const T* x = static_cast<const T*>(logits);
  float2* st = reinterpret_cast<float2*>(stats);
  if (rows == 0) {
    // nothing to reduce; the loss kernel still writes count 0 and the loss
  } else if (vectorizable<T>(x, x, cols)) {
    row_stats_kernel<T, true><<<(unsigned)rows, kThreads, 0, s>>>(x, st, cols, valid);
  } else {
    row_stats_kernel<T, false><<<(unsigned)rows, kThreads, 0, s>>>(x, st, cols, valid);
  }
  loss_kernel<T><<<1, kLossThreads, 0, s>>>(x, labels, st, loss, count, rows, cols, valid, ignore, has_ignore, reduction);
  return (int)cudaGetLastError();
}

template <typename T>
int backward(const void* logits, const int64_t* labels, const float* stats, const float* count, const float* dloss,
             void* dx, size_t rows, size_t cols, size_t valid, int64_t ignore, bool has_ignore, int reduction,
             cudaStream_t s) {
  const T* x = static_cast<const T*>(logits);
  const float2* st = reinterpret_cast<const float2*>(stats);
  T* d = static_cast<T*>(dx);
  if (vectorizable<T>(x, d, cols))
    rows_grad_kernel<T, true><<<(unsigned)rows, kThreads, 0, s>>>(x, labels, st, count, dloss, d, cols, valid, ignore,
                                                                  has_ignore, reduction);
  else
    rows_grad_kernel<T, false><<<(unsigned)rows, kThreads, 0, s>>>(x, labels, st, count, dloss, d, cols, valid, ignore,
                                                                   has_ignore, reduction);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int mpg_ce_rows_cuda(int type, const void* logits, const int64_t* labels, float* loss, float* stats,
                                float* count, size_t rows, size_t cols, size_t valid, int64_t ignore, bool has_ignore,
                                int reduction, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16)
    return forward<__nv_bfloat16>(logits, labels, loss, stats, count, rows, cols, valid, ignore, has_ignore, reduction, s);
  if (type == kTypeFloat16)
    return forward<__half>(logits, labels, loss, stats, count, rows, cols, valid, ignore, has_ignore, reduction, s);
  return forward<float>(logits, labels, loss, stats, count, rows, cols, valid, ignore, has_ignore, reduction, s);
}

extern "C" int mpg_ce_rows_grad_cuda(int type, const void* logits, const int64_t* labels, const float* stats,
                                     const float* count, const float* dloss, void* dx, size_t rows, size_t cols,
                                     size_t valid, int64_t ignore, bool has_ignore, int reduction, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type == kTypeBFloat16)
    return backward<__nv_bfloat16>(logits, labels, stats, count, dloss, dx, rows, cols, valid, ignore, has_ignore,
                                   reduction, s);
  if (type == kTypeFloat16)
    return backward<__half>(logits, labels, stats, count, dloss, dx, rows, cols, valid, ignore, has_ignore, reduction, s);
  return backward<float>(logits, labels, stats, count, dloss, dx, rows, cols, valid, ignore, has_ignore, reduction, s);
}
