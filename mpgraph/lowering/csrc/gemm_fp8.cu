// GemmFp8 on CUDA: one cuBLASLt fp8 matmul per call (gemm_fp8.h), with the cuBLASLt handle, a
// 32 MiB workspace per (device, stream) and each shape's descriptors and algorithm kept across
// calls, so nothing allocates or synchronises once a shape has run (a CUDA graph can capture it).
// Built only with cuBLASLt (MPG_WITH_CUBLASLT); otherwise this file is empty.
//
// Row-major Y [M, N] = A [M, K] B [N, K]^T is column-major Y^T [N, M] = B A^T: cuBLASLt's "A" is
// our B, stored K x N column-major (ld K) and transposed (CUBLAS_OP_T), its "B" our A, stored
// K x M (ld K) as it is; D is N x M with leading dimension N. That is the TN layout fp8 needs.
// Compute type float32, with fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM = 1, what ORT's
// GemmFloat8 sets) for E4M3 x E4M3 products only (see describe); the scales are device pointers (A_SCALE/B_SCALE_POINTER). Where cuBLASLt
// has no algorithm writing bfloat16 for a pair of formats, the product goes to a float32 scratch
// buffer (allocated the first time that shape runs) and is rounded to bfloat16 after. A bias
// (bfloat16 [N]) is cuBLASLt's bias epilogue, or added in that rounding pass.
#ifdef MPG_WITH_CUBLASLT
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "cublaslt_context.h"
#include "gemm_fp8.h"

namespace {

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  bool via_float = false;  // D is float32 scratch, rounded to bfloat16 after (the bias added there)
  bool epilogue_bias = false;  // cuBLASLt adds the bias (CUBLASLT_EPILOGUE_BIAS)
};

// (device, type_a, type_b, m, n, k, bias)
using PlanKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, bool>;

std::mutex g_mutex;  // guards everything below; a launch is queued with it held
std::map<std::pair<int, void*>, std::pair<void*, size_t>> g_scratch;  // float32 D buffers
std::map<PlanKey, Plan> g_plans;
std::string g_error;

int fail(const std::string& what, int code) {
  g_error = what + " (status " + std::to_string(code) + ")";
  return code ? code : -1;
}

#define MPG_LT(call)                                                             \
  do {                                                                           \
    const cublasStatus_t st_ = (call);                                           \
    if (st_ != CUBLAS_STATUS_SUCCESS) return fail(#call, static_cast<int>(st_)); \
  } while (0)

cudaDataType_t fp8_type(int onnx) { return onnx == 19 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

void destroy(Plan* plan) {
  if (plan->a) cublasLtMatrixLayoutDestroy(plan->a);
  if (plan->b) cublasLtMatrixLayoutDestroy(plan->b);
  if (plan->d) cublasLtMatrixLayoutDestroy(plan->d);
  if (plan->desc) cublasLtMatmulDescDestroy(plan->desc);
  *plan = Plan();
}

// The descriptors of ``s`` writing D as ``d_type`` and the heuristic's first algorithm
// (``*found``: whether there is one).
int describe(cublasLtHandle_t handle, const GemmFp8Shape& s, cudaDataType_t d_type, Plan* plan, bool* found) {
  const cublasOperation_t op_a = CUBLAS_OP_T, op_b = CUBLAS_OP_N;
  // Fast accumulation (Hopper's fp8 tensor cores keep the running sum in fewer bits) only where
  // both operands are E4M3, the forward products; a gradient product (an E5M2 operand) promotes
  // its sums to float32 as it goes, as Transformer Engine's recipe does for dgrad and wgrad,
  // whose K (the tokens, for wgrad) is the longest sum of the step.
  const int8_t fast = s.type_a != 19 && s.type_b != 19;
  MPG_LT(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  if (s.bias && d_type == CUDA_R_16BF) {  // D's rows (column-major: our Y's columns, N) get Bias[row]
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    MPG_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    plan->epilogue_bias = true;
  }
  const uint64_t n = static_cast<uint64_t>(s.n), m = static_cast<uint64_t>(s.m), k = static_cast<uint64_t>(s.k);
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->a, fp8_type(s.type_b), k, n, static_cast<int64_t>(k)));
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->b, fp8_type(s.type_a), k, m, static_cast<int64_t>(k)));
  MPG_LT(cublasLtMatrixLayoutCreate(&plan->d, d_type, n, m, static_cast<int64_t>(n)));
  if (int st = mpg_lt_first_algo(handle, plan->desc, plan->a, plan->b, plan->d, nullptr, &plan->algo, found))
    return fail("cublasLtMatmulPreferenceCreate(&pref)", st);
  return 0;
}

// bfloat16 D where cuBLASLt has an algorithm for it, else float32 D and a rounding pass.
int make_plan(cublasLtHandle_t handle, const GemmFp8Shape& s, Plan* plan) {
  bool found = false;
  if (int rc = describe(handle, s, CUDA_R_16BF, plan, &found)) return rc;
  if (found) return 0;
  destroy(plan);
  if (int rc = describe(handle, s, CUDA_R_32F, plan, &found)) return rc;
  plan->via_float = true;
  return found ? 0 : fail("cuBLASLt has no fp8 algorithm for this GEMM", static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED));
}

// y = bf16(x (+ bias[column])), one rounding; ``bias`` bfloat16 [cols] or nullptr.
__global__ void round_to_bf16(const float* __restrict__ x, const __nv_bfloat16* __restrict__ bias, int64_t cols,
                              __nv_bfloat16* __restrict__ y, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(bias ? x[i] + __bfloat162float(bias[i % cols]) : x[i]);
}

// 32 x 32 tiles through shared memory (a padded row against bank conflicts); blocks of 32 x 8
// threads, each thread four rows of its tile; tile rows along the grid's x (no 65535 limit).
__global__ void transpose_bytes(const uint8_t* __restrict__ x, uint8_t* __restrict__ y, int64_t rows, int64_t cols) {
  __shared__ uint8_t tile[32][33];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 32, c0 = static_cast<int64_t>(blockIdx.y) * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = x[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (c < cols && r < rows) y[c * rows + r] = tile[threadIdx.x][i];
  }
}

// The 64 x 64 byte tile of x rows r0.. and columns c0.. (tile[i][j]: row r0 + i, column c0 + j),
// stored transposed into y [cols, rows] by a block of 16 x 16 threads: each thread one 32-bit word
// (four x rows) of four y rows. Rows and cols multiples of 4; the caller synchronised the block.
__device__ __forceinline__ void store_tile_transposed(const uint8_t (*tile)[68], uint32_t* __restrict__ y, int64_t r0,
                                                      int64_t c0, int64_t rows, int64_t cols) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t rows4 = rows / 4;
  for (int i = ty; i < 64; i += 16) {  // y row c0 + i (x column), bytes r0 + 4 tx .. + 3 (x rows)
    const int64_t yr = c0 + i, yc4 = r0 / 4 + tx;
    if (yr < cols && yc4 < rows4)
      y[yr * rows4 + yc4] = static_cast<uint32_t>(tile[4 * tx][i]) | static_cast<uint32_t>(tile[4 * tx + 1][i]) << 8 |
                            static_cast<uint32_t>(tile[4 * tx + 2][i]) << 16 |
                            static_cast<uint32_t>(tile[4 * tx + 3][i]) << 24;
  }
}

// The same transpose four bytes at a time, for rows and columns that are multiples of 4 and
// 4-byte aligned buffers (every fp8 GEMM operand: its dims are multiples of 16): 64 x 64 tiles,
// blocks of 16 x 16 threads, each thread loading one 32-bit word of four tile rows and storing
// one word of four output rows. The byte kernel above moves one byte a thread and load; this
// one a word, with 64-byte rows per half-warp on both sides.
__global__ void transpose_words(const uint32_t* __restrict__ x, uint32_t* __restrict__ y, int64_t rows, int64_t cols) {
  __shared__ uint8_t tile[64][68];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 64, c0 = static_cast<int64_t>(blockIdx.y) * 64;
  const int64_t cols4 = cols / 4;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int i = ty; i < 64; i += 16) {  // tile row i: x row r0 + i, bytes c0 + 4 tx .. + 3
    const int64_t r = r0 + i, c4 = c0 / 4 + tx;
    if (r < rows && c4 < cols4) {
      const uint32_t w = x[r * cols4 + c4];
      tile[i][4 * tx] = static_cast<uint8_t>(w);
      tile[i][4 * tx + 1] = static_cast<uint8_t>(w >> 8);
      tile[i][4 * tx + 2] = static_cast<uint8_t>(w >> 16);
      tile[i][4 * tx + 3] = static_cast<uint8_t>(w >> 24);
    }
  }
  __syncthreads();
  store_tile_transposed(tile, y, r0, c0, rows, cols);
}

// |x| as the bits of a non-negative float32: larger values have larger bits, NaN above inf.
__device__ __forceinline__ unsigned abs_bits(const void* x, int type, int64_t i) {
  unsigned bits;
  if (type == 16) bits = static_cast<unsigned>(static_cast<const uint16_t*>(x)[i]) << 16;
  else if (type == 10) bits = __float_as_uint(__half2float(static_cast<const __half*>(x)[i]));
  else bits = __float_as_uint(static_cast<const float*>(x)[i]);
  return bits & 0x7fffffffu;
}

// *out = max(*out, the largest m of the block's threads): a warp shuffle, the warps' maxima
// through shared memory, one atomicMax a block. ``tid`` is the thread's index in the block,
// ``threads`` the block's size (a multiple of 32, at most 1024); every thread calls it.
__device__ __forceinline__ void block_max_into(unsigned m, unsigned* out, int tid, int threads) {
  __shared__ unsigned warps[32];
  for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_down_sync(0xffffffffu, m, offset));
  if (tid % 32 == 0) warps[tid / 32] = m;
  __syncthreads();
  if (tid < 32) {
    m = tid < threads / 32 ? warps[tid] : 0;
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_down_sync(0xffffffffu, m, offset));
    if (tid == 0) atomicMax(out, m);
  }
}

__global__ void absmax(const void* __restrict__ x, int type, int64_t n, unsigned* __restrict__ out) {
  unsigned m = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = max(m, abs_bits(x, type, i));
  block_max_into(m, out, threadIdx.x, blockDim.x);
}

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

// |v| of a float32 as its bits (larger values larger bits, a NaN above infinity), as abs_bits.
__device__ __forceinline__ unsigned magnitude(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// q[i] = fp8(x[i] * s) and, with ``amax``, max |x[i]| into *amax (atomicMax on its bits, which
// the launch zeroes first). The first ``vecs`` * V elements go 16 bytes of x a thread and load
// (V = 8 two-byte or 4 float32 elements; x 16-byte and q V-byte aligned, which the launch checks,
// else vecs = 0), the rest one element a thread. One read of x for both results: the amax the
// delayed recipe records of an fp8 tensor and its quantisation with last steps' scale.
template <typename T, bool kAmax>
__global__ void cast_fp8(const T* __restrict__ x, int64_t n, int64_t vecs, const float* __restrict__ scale,
                         __nv_fp8_storage_t* __restrict__ q, __nv_fp8_interpretation_t kind, unsigned* __restrict__ amax) {
  constexpr int V = 16 / sizeof(T);
  const float s = *scale;
  unsigned m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t v = first; v < vecs; v += stride) {
    const uint4 raw = reinterpret_cast<const uint4*>(x)[v];
    const T* e = reinterpret_cast<const T*>(&raw);
    union { __nv_fp8_storage_t b[V]; uint32_t w[V / 4]; } out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float f = widen(e[j]);
      if (kAmax) m = max(m, magnitude(f));
      out.b[j] = __nv_cvt_float_to_fp8(__fmul_rn(f, s), __NV_SATFINITE, kind);
    }
    if constexpr (V == 8) reinterpret_cast<uint2*>(q)[v] = make_uint2(out.w[0], out.w[1]);
    else reinterpret_cast<uint32_t*>(q)[v] = out.w[0];
  }
  for (int64_t i = vecs * V + first; i < n; i += stride) {
    const float f = widen(x[i]);
    if (kAmax) m = max(m, magnitude(f));
    q[i] = __nv_cvt_float_to_fp8(__fmul_rn(f, s), __NV_SATFINITE, kind);
  }
  if constexpr (kAmax) block_max_into(m, amax, threadIdx.x, blockDim.x);
}

template <typename T>
int launch_cast_fp8(const void* x, int64_t n, const float* scale, void* q, int to, float* amax, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % V == 0;
  const int64_t vecs = aligned ? n / V : 0;
  const int64_t work = vecs + (n - vecs * V);  // threads' worth: one a vector, one a leftover element
  const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, 4096));
  const __nv_fp8_interpretation_t kind = to == 19 ? __NV_E5M2 : __NV_E4M3;
  const T* xt = static_cast<const T*>(x);
  __nv_fp8_storage_t* qt = static_cast<__nv_fp8_storage_t*>(q);
  if (amax)
    cast_fp8<T, true><<<blocks, 256, 0, stream>>>(xt, n, vecs, scale, qt, kind, reinterpret_cast<unsigned*>(amax));
  else
    cast_fp8<T, false><<<blocks, 256, 0, stream>>>(xt, n, vecs, scale, qt, kind, nullptr);
  if (cudaError_t err = cudaGetLastError()) return fail("cast_fp8 launch", static_cast<int>(err));
  return 0;
}

// Four consecutive elements of x (16-byte aligned for float32, 8-byte for the two-byte types) as float32.
__device__ __forceinline__ void load4(const float* x, float v[4]) {
  const float4 w = *reinterpret_cast<const float4*>(x);
  v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* x, float v[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(x);
  v[0] = __uint_as_float(w.x << 16), v[1] = __uint_as_float(w.x & 0xffff0000u);
  v[2] = __uint_as_float(w.y << 16), v[3] = __uint_as_float(w.y & 0xffff0000u);
}
__device__ __forceinline__ void load4(const __half* x, float v[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(x);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

// q = fp8(x * s) [rows, cols], qt = q^T [cols, rows] and *amax = max |x| (atomicMax on its bits;
// the launch zeroes it) in one read of x: the fp8 operand a GemmFp8 reads as it is and the one
// another reads transposed (rule 9). 64 x 64 tiles, blocks of 16 x 16 threads: each thread
// converts four elements of four tile rows (one 8- or 16-byte load of x each), writes their four
// bytes to q as one word and to the tile; after the barrier, one word of four qt rows, as
// transpose_words. Rows and cols multiples of 4 and aligned buffers (the launch checks).
template <typename T>
__global__ void cast_transpose_fp8(const T* __restrict__ x, int64_t rows, int64_t cols, const float* __restrict__ scale,
                                   __nv_fp8_interpretation_t kind, uint32_t* __restrict__ q, uint32_t* __restrict__ qt,
                                   unsigned* __restrict__ amax) {
  __shared__ uint8_t tile[64][68];
  const float s = *scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 64, c0 = static_cast<int64_t>(blockIdx.y) * 64;
  const int64_t cols4 = cols / 4;
  const int tx = threadIdx.x, ty = threadIdx.y;
  unsigned m = 0;
  for (int i = ty; i < 64; i += 16) {  // tile row i: x row r0 + i, elements c0 + 4 tx .. + 3
    const int64_t r = r0 + i, c4 = c0 / 4 + tx;
    if (r < rows && c4 < cols4) {
      float v[4];
      load4(x + r * cols + 4 * c4, v);
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        m = max(m, magnitude(v[j]));
        const uint8_t b = __nv_cvt_float_to_fp8(__fmul_rn(v[j], s), __NV_SATFINITE, kind);
        tile[i][4 * tx + j] = b;
        w |= static_cast<uint32_t>(b) << (8 * j);
      }
      q[r * cols4 + c4] = w;
    }
  }
  __syncthreads();
  store_tile_transposed(tile, qt, r0, c0, rows, cols);
  block_max_into(m, amax, ty * 16 + tx, 256);
}

template <typename T>
int launch_cast_transpose_fp8(const void* x, int64_t rows, int64_t cols, const float* scale, void* q, void* qt, int to,
                              float* amax, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((rows + 63) / 64), static_cast<unsigned>((cols + 63) / 64)), block(16, 16);
  cast_transpose_fp8<T><<<grid, block, 0, stream>>>(static_cast<const T*>(x), rows, cols, scale,
                                                    to == 19 ? __NV_E5M2 : __NV_E4M3, static_cast<uint32_t*>(q),
                                                    static_cast<uint32_t*>(qt), reinterpret_cast<unsigned*>(amax));
  if (cudaError_t err = cudaGetLastError()) return fail("cast_transpose_fp8 launch", static_cast<int>(err));
  return 0;
}

}  // namespace

extern "C" const char* mpg_gemm_fp8_last_error() { return g_error.c_str(); }

extern "C" int mpg_cast_fp8_cuda(const void* x, int type, int64_t n, const float* scale, void* q, int to, float* amax,
                                 void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (amax)
    if (cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return fail("cast_fp8 amax memset", static_cast<int>(err));
  if (n <= 0) return 0;
  if (type == 16) return launch_cast_fp8<__nv_bfloat16>(x, n, scale, q, to, amax, stream);
  if (type == 10) return launch_cast_fp8<__half>(x, n, scale, q, to, amax, stream);
  return launch_cast_fp8<float>(x, n, scale, q, to, amax, stream);
}

extern "C" int mpg_cast_transpose_fp8_cuda(const void* x, int type, int64_t rows, int64_t cols, const float* scale,
                                           void* q, void* qt, int to, float* amax, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const size_t size = type == 1 ? 4 : 2;
  const bool tiles = rows % 4 == 0 && cols % 4 == 0 && reinterpret_cast<uintptr_t>(x) % (4 * size) == 0 &&
                     reinterpret_cast<uintptr_t>(q) % 4 == 0 && reinterpret_cast<uintptr_t>(qt) % 4 == 0 &&
                     (cols + 63) / 64 <= 65535;
  if (!tiles) {  // the cast (with its amax), then the transpose
    if (int rc = mpg_cast_fp8_cuda(x, type, rows * cols, scale, q, to, amax, stream_ptr)) return rc;
    return mpg_transpose_bytes_cuda(q, qt, rows, cols, stream_ptr);
  }
  if (cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(float), stream)) return fail("cast_transpose_fp8 amax memset", static_cast<int>(err));
  if (rows <= 0 || cols <= 0) return 0;
  if (type == 16) return launch_cast_transpose_fp8<__nv_bfloat16>(x, rows, cols, scale, q, qt, to, amax, stream);
  if (type == 10) return launch_cast_transpose_fp8<__half>(x, rows, cols, scale, q, qt, to, amax, stream);
  return launch_cast_transpose_fp8<float>(x, rows, cols, scale, q, qt, to, amax, stream);
}

extern "C" int mpg_absmax_cuda(const void* x, int type, int64_t n, float* out, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (cudaError_t err = cudaMemsetAsync(out, 0, sizeof(float), stream)) return fail("absmax memset", static_cast<int>(err));
  if (n <= 0) return 0;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 1023) / 1024, 1184));  // 8 a Hopper SM
  absmax<<<blocks, 1024, 0, stream>>>(x, type, n, reinterpret_cast<unsigned*>(out));
  if (cudaError_t err = cudaGetLastError()) return fail("absmax launch", static_cast<int>(err));
  return 0;
}

extern "C" int mpg_transpose_bytes_cuda(const void* x, void* y, int64_t rows, int64_t cols, void* stream_ptr) {
  if (rows <= 0 || cols <= 0) return 0;
  const bool words = rows % 4 == 0 && cols % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(y) % 4 == 0 && (cols + 63) / 64 <= 65535;
  if (words) {
    const dim3 grid(static_cast<unsigned>((rows + 63) / 64), static_cast<unsigned>((cols + 63) / 64)), block(16, 16);
    transpose_words<<<grid, block, 0, static_cast<cudaStream_t>(stream_ptr)>>>(static_cast<const uint32_t*>(x),
                                                                              static_cast<uint32_t*>(y), rows, cols);
    if (cudaError_t err = cudaGetLastError()) return fail("transpose_words launch", static_cast<int>(err));
    return 0;
  }
  const int64_t grid_y = (cols + 31) / 32;  // rows along x (2^31 - 1 tiles), columns along y
  if (grid_y > 65535) return fail("transpose_bytes: more than 65535 x 32 columns", -1);
  const dim3 grid(static_cast<unsigned>((rows + 31) / 32), static_cast<unsigned>(grid_y)), block(32, 8);
  transpose_bytes<<<grid, block, 0, static_cast<cudaStream_t>(stream_ptr)>>>(static_cast<const uint8_t*>(x),
                                                                              static_cast<uint8_t*>(y), rows, cols);
  if (cudaError_t err = cudaGetLastError()) return fail("transpose_bytes launch", static_cast<int>(err));
  return 0;
}

extern "C" int mpg_gemm_fp8_cuda(const GemmFp8Shape* shape, const void* a, const void* b, const float* scale_a,
                                 const float* scale_b, const void* bias, void* y, void* stream_ptr) {
  const GemmFp8Shape& s = *shape;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::lock_guard<std::mutex> lock(g_mutex);
  int device = 0;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::string what;
  if (int err = mpg_lt_context(stream_ptr, &device, &handle, &workspace, &what)) return fail(what, err);
  const PlanKey key{device, s.type_a, s.type_b, s.m, s.n, s.k, s.bias};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    Plan plan;
    if (int rc = make_plan(handle, s, &plan)) {
      destroy(&plan);
      return rc;
    }
    it = g_plans.emplace(key, plan).first;
  }
  Plan& plan = it->second;
  void* d = y;
  const int64_t total = s.m * s.n;
  if (plan.via_float) {
    std::pair<void*, size_t>& scratch = g_scratch[{device, stream_ptr}];
    const size_t bytes = static_cast<size_t>(total) * sizeof(float);
    if (scratch.second < bytes) {  // the first call of a larger shape: before any capture
      if (scratch.first) cudaFree(scratch.first);
      scratch = {nullptr, 0};
      if (cudaError_t err = cudaMalloc(&scratch.first, bytes)) return fail("cudaMalloc of the float32 scratch", static_cast<int>(err));
      scratch.second = bytes;
    }
    d = scratch.first;
  }
  // cuBLASLt's A is our B (its scale scale_b), its B our A.
  MPG_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof(scale_b)));
  MPG_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof(scale_a)));
  if (plan.epilogue_bias) MPG_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  const float alpha = s.alpha, beta = 0.0f;
  MPG_LT(cublasLtMatmul(handle, plan.desc, &alpha, b, plan.a, a, plan.b, &beta, d, plan.d, d, plan.d, &plan.algo,
                        workspace, kLtWorkspaceBytes, stream));
  if (plan.via_float) {
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
    round_to_bf16<<<blocks, 256, 0, stream>>>(static_cast<const float*>(d), plan.epilogue_bias ? nullptr :
                                              static_cast<const __nv_bfloat16*>(bias), s.n, static_cast<__nv_bfloat16*>(y), total);
    if (cudaError_t err = cudaGetLastError()) return fail("round_to_bf16 launch", static_cast<int>(err));
  }
  return 0;
}
#endif  // MPG_WITH_CUBLASLT
