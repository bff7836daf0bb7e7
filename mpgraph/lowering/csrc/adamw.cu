// The CUDA side of AdamWUpdate (see kernels.cc): one pass, float4 loads where aligned, and the
// intrinsics that round each operation on its own (__fmul_rn and friends are never contracted
// into fused multiply-adds), so the results equal ORT's separate elementwise kernels bit for bit.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

struct Scalars {
  const float* s[7];
};

__device__ __forceinline__ void step(float p, float g, float m, float v, float c1, float b2, float c2, float bc2_sqrt,
                                     float eps, float step_size, float decay, float* po, float* mo, float* vo) {
  const float m_new = __fadd_rn(m, __fmul_rn(__fsub_rn(g, m), c1));
  const float v_new = __fadd_rn(__fmul_rn(v, b2), __fmul_rn(__fmul_rn(g, g), c2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), bc2_sqrt), eps);
  const float update = __fmul_rn(__fdiv_rn(m_new, denom), step_size);
  *po = __fsub_rn(__fmul_rn(p, decay), update);
  *mo = m_new;
  *vo = v_new;
}

__global__ void adamw_kernel(const float* __restrict__ p, const float* __restrict__ g, const float* __restrict__ m,
                             const float* __restrict__ v, Scalars sc, float* __restrict__ po, float* __restrict__ mo,
                             float* __restrict__ vo, size_t n, bool vec4) {
  const float c1 = *sc.s[0], b2 = *sc.s[1], c2 = *sc.s[2], bc2_sqrt = *sc.s[3], eps = *sc.s[4], step_size = *sc.s[5],
              decay = *sc.s[6];
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t start = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t tail = 0;
  if (vec4) {
    const size_t n4 = n / 4;
    for (size_t i = start; i < n4; i += stride) {
      const float4 p4 = reinterpret_cast<const float4*>(p)[i], g4 = reinterpret_cast<const float4*>(g)[i];
      const float4 m4 = reinterpret_cast<const float4*>(m)[i], v4 = reinterpret_cast<const float4*>(v)[i];
      float4 a, b, c;
      step(p4.x, g4.x, m4.x, v4.x, c1, b2, c2, bc2_sqrt, eps, step_size, decay, &a.x, &b.x, &c.x);
      step(p4.y, g4.y, m4.y, v4.y, c1, b2, c2, bc2_sqrt, eps, step_size, decay, &a.y, &b.y, &c.y);
      step(p4.z, g4.z, m4.z, v4.z, c1, b2, c2, bc2_sqrt, eps, step_size, decay, &a.z, &b.z, &c.z);
      step(p4.w, g4.w, m4.w, v4.w, c1, b2, c2, bc2_sqrt, eps, step_size, decay, &a.w, &b.w, &c.w);
      reinterpret_cast<float4*>(po)[i] = a;
      reinterpret_cast<float4*>(mo)[i] = b;
      reinterpret_cast<float4*>(vo)[i] = c;
    }
    tail = n4 * 4;
  }
  for (size_t i = tail + start; i < n; i += stride)
    step(p[i], g[i], m[i], v[i], c1, b2, c2, bc2_sqrt, eps, step_size, decay, po + i, mo + i, vo + i);
}

bool aligned(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

extern "C" int mpg_adamw_cuda(const float* p, const float* g, const float* m, const float* v, const float* const* scalars,
                              float* p_out, float* m_out, float* v_out, size_t n, void* stream) {
  Scalars sc;
  for (int i = 0; i < 7; ++i) sc.s[i] = scalars[i];
  const bool vec4 = aligned(p) && aligned(g) && aligned(m) && aligned(v) && aligned(p_out) && aligned(m_out) && aligned(v_out);
  const int threads = 256;
  size_t work = vec4 ? (n + 3) / 4 : n;
  size_t blocks = (work + threads - 1) / threads;
  if (blocks > 4096) blocks = 4096;
  if (blocks == 0) blocks = 1;
  adamw_kernel<<<(unsigned)blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(p, g, m, v, sc, p_out, m_out, v_out, n, vec4);
  return (int)cudaGetLastError();
}
