// The CUDA side of the multi-tensor ops (see kernels.cc): one launch covers up to
// kMaxTensors tensors. Each tensor is cut into chunks of kChunk elements; a block takes one
// chunk, and finds its tensor in the table's prefix sums of chunk counts (the table travels
// as a kernel argument, under CUDA's 4 KB limit). Every operation rounds on its own
// (__fmul_rn and friends), as ORT's separate elementwise kernels do.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "multi.h"

namespace {

constexpr int kThreads = 256;

struct Table {
  const void* in[kMaxTensors][4];
  void* out[kMaxTensors][3];
  long long n[kMaxTensors];
  int first_block[kMaxTensors + 1];
  int type[kMaxTensors];
  int count;
};

__device__ __forceinline__ int find_tensor(const Table& t, int block) {
  int i = 0;
  while (i + 1 < t.count && t.first_block[i + 1] <= block) ++i;
  return i;
}

__device__ __forceinline__ void chunk_range(const Table& t, int i, long long* start, long long* end) {
  *start = (long long)(blockIdx.x - t.first_block[i]) * kChunk;
  *end = *start + kChunk < t.n[i] ? *start + kChunk : t.n[i];
}

__device__ __forceinline__ float load(const void* p, int type, long long k) {
  if (type == kTypeFloat16) return __half2float(static_cast<const __half*>(p)[k]);
  if (type == kTypeBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[k]);
  return static_cast<const float*>(p)[k];
}

struct AdamScalars {
  const float* s[7];
};

__global__ void multi_adamw_kernel(Table t, AdamScalars sc) {
  const int i = find_tensor(t, blockIdx.x);
  long long start, end;
  chunk_range(t, i, &start, &end);
  const float c1 = *sc.s[0], b2 = *sc.s[1], c2 = *sc.s[2], bc2_sqrt = *sc.s[3], eps = *sc.s[4], step_size = *sc.s[5],
              decay = *sc.s[6];
  const float* p = static_cast<const float*>(t.in[i][0]);
  const float* g = static_cast<const float*>(t.in[i][1]);
  const float* m = static_cast<const float*>(t.in[i][2]);
  const float* v = static_cast<const float*>(t.in[i][3]);
  float* po = static_cast<float*>(t.out[i][0]);
  float* mo = static_cast<float*>(t.out[i][1]);
  float* vo = static_cast<float*>(t.out[i][2]);
  for (long long k = start + threadIdx.x; k < end; k += blockDim.x) {
    const float gk = g[k], mk = m[k], vk = v[k];
    const float m_new = __fadd_rn(mk, __fmul_rn(__fsub_rn(gk, mk), c1));
    const float v_new = __fadd_rn(__fmul_rn(vk, b2), __fmul_rn(__fmul_rn(gk, gk), c2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), bc2_sqrt), eps);
    const float update = __fmul_rn(__fdiv_rn(m_new, denom), step_size);
    po[k] = __fsub_rn(__fmul_rn(p[k], decay), update);
    mo[k] = m_new;
    vo[k] = v_new;
  }
}

__global__ void multi_cast_kernel(Table t, int to) {
  const int i = find_tensor(t, blockIdx.x);
  long long start, end;
  chunk_range(t, i, &start, &end);
  const float* x = static_cast<const float*>(t.in[i][0]);
  for (long long k = start + threadIdx.x; k < end; k += blockDim.x) {
    if (to == kTypeBFloat16)
      static_cast<__nv_bfloat16*>(t.out[i][0])[k] = __float2bfloat16(x[k]);
    else
      static_cast<__half*>(t.out[i][0])[k] = __float2half(x[k]);
  }
}

__global__ void unscale_check_kernel(Table t, const float* inv_scale, bool* found) {
  const int i = find_tensor(t, blockIdx.x);
  long long start, end;
  chunk_range(t, i, &start, &end);
  const float inv = *inv_scale;
  int bad = 0;
  for (long long k = start + threadIdx.x; k < end; k += blockDim.x)
    bad |= !isfinite(__fmul_rn(load(t.in[i][0], t.type[i], k), inv));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = true;
}

__global__ void unscale_apply_kernel(Table t, const float* inv_scale, const bool* found) {
  const int i = find_tensor(t, blockIdx.x);
  long long start, end;
  chunk_range(t, i, &start, &end);
  const float inv = *inv_scale;
  const bool skip = *found;
  float* u = static_cast<float*>(t.out[i][0]);
  for (long long k = start + threadIdx.x; k < end; k += blockDim.x)
    u[k] = skip ? 0.0f : __fmul_rn(load(t.in[i][0], t.type[i], k), inv);
}

// Fill ``table`` from tensors [first, first + count) of ``batch``; the number of blocks.
int fill(const MultiBatch& batch, int first, int count, Table* table) {
  int blocks = 0;
  table->count = count;
  for (int j = 0; j < count; ++j) {
    const MultiTensor& src = batch.tensors[first + j];
    for (int k = 0; k < 4; ++k) table->in[j][k] = src.in[k];
    for (int k = 0; k < 3; ++k) table->out[j][k] = src.out[k];
    table->n[j] = (long long)src.n;
    table->type[j] = src.type;
    table->first_block[j] = blocks;
    blocks += (int)((src.n + kChunk - 1) / kChunk);
  }
  table->first_block[count] = blocks;
  return blocks;
}

}  // namespace

extern "C" int mpg_multi_cuda(int op, const MultiBatch* batch, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (op == kMultiUnscale) {
    cudaError_t err = cudaMemsetAsync(batch->found, 0, sizeof(bool), stream);
    if (err != cudaSuccess) return (int)err;
  }
  // The unscale's apply launches wait for every check launch: two sweeps over the batch.
  const int sweeps = op == kMultiUnscale ? 2 : 1;
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    for (int first = 0; first < batch->count; first += kMaxTensors) {
      Table table;
      const int count = batch->count - first < kMaxTensors ? batch->count - first : kMaxTensors;
      const int blocks = fill(*batch, first, count, &table);
      if (blocks == 0) continue;
      if (op == kMultiAdamW) {
        AdamScalars sc;
        for (int k = 0; k < 7; ++k) sc.s[k] = batch->scalars[k];
        multi_adamw_kernel<<<blocks, kThreads, 0, stream>>>(table, sc);
      } else if (op == kMultiCastBFloat16 || op == kMultiCastFloat16) {
        multi_cast_kernel<<<blocks, kThreads, 0, stream>>>(table, op == kMultiCastBFloat16 ? kTypeBFloat16 : kTypeFloat16);
      } else if (sweep == 0) {
        unscale_check_kernel<<<blocks, kThreads, 0, stream>>>(table, batch->scalars[0], batch->found);
      } else {
        unscale_apply_kernel<<<blocks, kThreads, 0, stream>>>(table, batch->scalars[0], batch->found);
      }
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return (int)err;
    }
  }
  return 0;
}
