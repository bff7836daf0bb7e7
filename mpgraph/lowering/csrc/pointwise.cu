// The CUDA side of Pointwise (see kernels.cc and pointwise.h): a grid-stride loop, each thread
// running the register program on its elements; memory-bound, one read of each input and one
// write of each output per element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_util.h"
#include "pointwise.h"

namespace {

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

__global__ void pointwise_kernel(const PwProgram program, const PwArgs args) {
  float r[kPwMaxRegisters];
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < args.n; i += stride) {
    for (int k = 0; k < args.inputs; ++k) r[k] = pw_load(args.in[k], args.in_type[k], pw_index(args.in_mode[k], i, args.last));
    pw_exec<PwGpuRound>(program, r);
    for (int k = 0; k < args.outputs; ++k) {
      const float v = r[args.out_reg[k]];
      if (args.out_type[k] == 16)
        static_cast<__nv_bfloat16*>(args.out[k])[i] = __float2bfloat16_rn(v);
      else if (args.out_type[k] == 10)
        static_cast<__half*>(args.out[k])[i] = __float2half_rn(v);
      else
        static_cast<float*>(args.out[k])[i] = v;
    }
  }
}

}  // namespace

extern "C" int mpg_pointwise_cuda(const PwProgram* program, const PwArgs* args, void* stream) {
  int64_t blocks = (args->n + 255) / 256;
  if (blocks > 132 * 16) blocks = 132 * 16;  // a few waves of every SM; the loop takes the rest
  pointwise_kernel<<<(unsigned)(blocks ? blocks : 1), 256, 0, static_cast<cudaStream_t>(stream)>>>(*program, *args);
  return (int)cudaGetLastError();
}
