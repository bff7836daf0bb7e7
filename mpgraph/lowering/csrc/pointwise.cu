// The CUDA side of Pointwise (see kernels.cc and pointwise.h): a grid-stride loop, each thread
// running the register program on four adjacent elements at a time (one decode of each
// instruction for four, 16- or 8-byte loads and stores of full-size tensors), the rest of the
// elements one by one. Memory-bound: one read of each input and one write of each output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_util.h"
#include "pointwise.h"

namespace {

constexpr int kLanes = 4;

struct PwGpuRound {
  static __device__ __forceinline__ float bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
  static __device__ __forceinline__ float f16(float v) { return __half2float(__float2half_rn(v)); }
  static __device__ __forceinline__ float sqrt(float v) { return __fsqrt_rn(v); }
};

__device__ __forceinline__ float pw_load(const void* p, int type, int64_t k) {
  if (type == 16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[k]);
  if (type == 10) return __half2float(static_cast<const __half*>(p)[k]);
  return static_cast<const float*>(p)[k];
}

__device__ __forceinline__ void pw_store(void* p, int type, int64_t k, float v) {
  if (type == 16)
    static_cast<__nv_bfloat16*>(p)[k] = __float2bfloat16_rn(v);
  else if (type == 10)
    static_cast<__half*>(p)[k] = __float2half_rn(v);
  else
    static_cast<float*>(p)[k] = v;
}

// Elements i0..i0+3 of a full-size input (i0 a multiple of 4: ORT's buffers are aligned).
__device__ __forceinline__ void pw_load4(const void* p, int type, int64_t i0, float* v) {
  if (type == 1) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i0);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    return;
  }
  const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i0);
  const uint16_t h[4] = {(uint16_t)(q.x & 0xFFFF), (uint16_t)(q.x >> 16), (uint16_t)(q.y & 0xFFFF), (uint16_t)(q.y >> 16)};
  for (int l = 0; l < kLanes; ++l)
    v[l] = type == 16 ? __bfloat162float(__ushort_as_bfloat16(h[l])) : __half2float(__ushort_as_half(h[l]));
}

__device__ __forceinline__ void pw_store4(void* p, int type, int64_t i0, const float* v) {
  if (type == 1) {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i0) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  uint16_t h[kLanes];
  for (int l = 0; l < kLanes; ++l)
    h[l] = type == 16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v[l])) : __half_as_ushort(__float2half_rn(v[l]));
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + i0) =
      make_uint2(h[0] | ((uint32_t)h[1] << 16), h[2] | ((uint32_t)h[3] << 16));
}

// The register file: float r[R][4]. Indexed by a run-time register number it would live in
// local memory; for R <= 8 every access is a chain of selects over constant indices instead, so
// the file stays in registers (R 16 and 24: local memory, in L1 while small).
template <int R>
struct PwFile {
  float r[R][kLanes];
  __device__ __forceinline__ float get(int idx, int l) const {
    if constexpr (R > 8) {
      return r[idx][l];
    } else {
      float v = r[0][l];
#pragma unroll
      for (int k = 1; k < R; ++k) v = idx == k ? r[k][l] : v;
      return v;
    }
  }
  __device__ __forceinline__ void set(int idx, int l, float v) {
    if constexpr (R > 8) {
      r[idx][l] = v;
    } else {
#pragma unroll
      for (int k = 0; k < R; ++k) r[k][l] = idx == k ? v : r[k][l];
    }
  }
};

template <int R>
__device__ __forceinline__ void pw_step(const PwProgram& program, PwFile<R>& f, int lanes) {
  for (int c = 0; c < program.count; ++c) {
    const PwInstr in = program.code[c];
    const bool binary = in.b < kPwMaxRegisters;
    float v[kLanes];
#pragma unroll
    for (int l = 0; l < kLanes; ++l)
      if (l < lanes) v[l] = pw_round<PwGpuRound>(in.t, pw_apply<PwGpuRound>(in.op, f.get(in.a, l), binary ? f.get(in.b, l) : 0.0f));
#pragma unroll
    for (int l = 0; l < kLanes; ++l)
      if (l < lanes) f.set(in.dst, l, v[l]);
  }
}

// R registers: the fewest of 4, 8, 16, 24 the program needs.
template <int R>
__global__ void pointwise_kernel(const PwProgram program, const PwArgs args) {
  PwFile<R> f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t quads = args.vector ? args.n / kLanes : 0;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < quads; q += stride) {
    const int64_t i0 = q * kLanes;
    for (int k = 0; k < args.inputs; ++k) {
      float v[kLanes];
      if (args.in_mode[k] == kPwFull) {
        pw_load4(args.in[k], args.in_type[k], i0, v);
      } else {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) v[l] = pw_load(args.in[k], args.in_type[k], pw_index(args.in_mode[k], i0 + l, args.last));
      }
#pragma unroll
      for (int l = 0; l < kLanes; ++l) f.set(k, l, v[l]);
    }
    pw_step<R>(program, f, kLanes);
    for (int k = 0; k < args.outputs; ++k) {
      float v[kLanes];
#pragma unroll
      for (int l = 0; l < kLanes; ++l) v[l] = f.get(args.out_reg[k], l);
      pw_store4(args.out[k], args.out_type[k], i0, v);
    }
  }
  // The rest, one element at a time in lane 0 (the last n % 4; all of them when not aligned).
  for (int64_t i = quads * kLanes + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < args.n; i += stride) {
    for (int k = 0; k < args.inputs; ++k) f.set(k, 0, pw_load(args.in[k], args.in_type[k], pw_index(args.in_mode[k], i, args.last)));
    pw_step<R>(program, f, 1);
    for (int k = 0; k < args.outputs; ++k) pw_store(args.out[k], args.out_type[k], i, f.get(args.out_reg[k], 0));
  }
}

}  // namespace

extern "C" int mpg_pointwise_cuda(const PwProgram* program, const PwArgs* args, void* stream) {
  int used = args->inputs;
  for (int c = 0; c < program->count; ++c) used = used > program->code[c].dst + 1 ? used : program->code[c].dst + 1;
  int64_t blocks = (args->n / (args->vector ? kLanes : 1) + 255) / 256;
  if (blocks > 132 * 8) blocks = 132 * 8;  // a few waves of every SM; the loop takes the rest
  const dim3 grid((unsigned)(blocks ? blocks : 1));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (used <= 4)
    pointwise_kernel<4><<<grid, 256, 0, s>>>(*program, *args);
  else if (used <= 8)
    pointwise_kernel<8><<<grid, 256, 0, s>>>(*program, *args);
  else if (used <= 16)
    pointwise_kernel<16><<<grid, 256, 0, s>>>(*program, *args);
  else
    pointwise_kernel<kPwMaxRegisters><<<grid, 256, 0, s>>>(*program, *args);
  return (int)cudaGetLastError();
}
