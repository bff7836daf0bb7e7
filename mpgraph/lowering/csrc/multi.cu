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

__device__ __forceinline__ void adam_step(float p, float g, float m, float v, const float* c, float* po, float* mo,
                                          float* vo) {
  // c: c1, b2, c2, bc2_sqrt, eps, step_size, decay
  const float m_new = __fadd_rn(m, __fmul_rn(__fsub_rn(g, m), c[0]));
  const float v_new = __fadd_rn(__fmul_rn(v, c[1]), __fmul_rn(__fmul_rn(g, g), c[2]));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), c[3]), c[4]);
  const float update = __fmul_rn(__fdiv_rn(m_new, denom), c[5]);
  *po = __fsub_rn(__fmul_rn(p, c[6]), update);
  *mo = m_new;
  *vo = v_new;
}

__device__ __forceinline__ bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// A chunk starts at a multiple of kChunk (a multiple of 4): where every pointer of the tensor
// is 16-byte aligned, the chunk's whole float4s go four at a time, its tail one at a time.
__global__ void multi_adamw_kernel(Table t, AdamScalars sc) {
  const int i = find_tensor(t, blockIdx.x);
  long long start, end;
  chunk_range(t, i, &start, &end);
  float c[7];
  for (int k = 0; k < 7; ++k) c[k] = *sc.s[k];
  const float* p = static_cast<const float*>(t.in[i][0]);
  const float* g = static_cast<const float*>(t.in[i][1]);
  const float* m = static_cast<const float*>(t.in[i][2]);
  const float* v = static_cast<const float*>(t.in[i][3]);
  float* po = static_cast<float*>(t.out[i][0]);
  float* mo = static_cast<float*>(t.out[i][1]);
  float* vo = static_cast<float*>(t.out[i][2]);
  long long k0 = start;
  if (aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned16(po) && aligned16(mo) && aligned16(vo)) {
    const long long quads = (end - start) / 4;
    for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
      const long long k = start + 4 * q;
      const float4 p4 = *reinterpret_cast<const float4*>(p + k), g4 = *reinterpret_cast<const float4*>(g + k);
      const float4 m4 = *reinterpret_cast<const float4*>(m + k), v4 = *reinterpret_cast<const float4*>(v + k);
      float4 a, b, d;
      adam_step(p4.x, g4.x, m4.x, v4.x, c, &a.x, &b.x, &d.x);
      adam_step(p4.y, g4.y, m4.y, v4.y, c, &a.y, &b.y, &d.y);
      adam_step(p4.z, g4.z, m4.z, v4.z, c, &a.z, &b.z, &d.z);
      adam_step(p4.w, g4.w, m4.w, v4.w, c, &a.w, &b.w, &d.w);
      *reinterpret_cast<float4*>(po + k) = a;
      *reinterpret_cast<float4*>(mo + k) = b;
      *reinterpret_cast<float4*>(vo + k) = d;
    }
    k0 = start + 4 * quads;
  }
  for (long long k = k0 + threadIdx.x; k < end; k += blockDim.x) adam_step(p[k], g[k], m[k], v[k], c, po + k, mo + k, vo + k);
}

__global__ void multi_cast_kernel(Table t, int to) {
  const int i = find_tensor(t, blockIdx.x);
  long long start, end;
  chunk_range(t, i, &start, &end);
  const float* x = static_cast<const float*>(t.in[i][0]);
  long long k0 = start;
  if (aligned16(x) && (reinterpret_cast<uintptr_t>(t.out[i][0]) & 7) == 0) {
    const long long quads = (end - start) / 4;
    for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
      const long long k = start + 4 * q;
      const float4 x4 = *reinterpret_cast<const float4*>(x + k);
      if (to == kTypeBFloat16) {
        __nv_bfloat16* y = static_cast<__nv_bfloat16*>(t.out[i][0]) + k;
        *reinterpret_cast<__nv_bfloat162*>(y) = __nv_bfloat162(__float2bfloat16(x4.x), __float2bfloat16(x4.y));
        *reinterpret_cast<__nv_bfloat162*>(y + 2) = __nv_bfloat162(__float2bfloat16(x4.z), __float2bfloat16(x4.w));
      } else {
        __half* y = static_cast<__half*>(t.out[i][0]) + k;
        *reinterpret_cast<__half2*>(y) = __half2(__float2half(x4.x), __float2half(x4.y));
        *reinterpret_cast<__half2*>(y + 2) = __half2(__float2half(x4.z), __float2half(x4.w));
      }
    }
    k0 = start + 4 * quads;
  }
  for (long long k = k0 + threadIdx.x; k < end; k += blockDim.x) {
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
