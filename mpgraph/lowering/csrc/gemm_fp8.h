// An fp8 GEMM with per-tensor scales: the interface between kernels.cc (the GemmFp8 custom op,
// its CPU reference loop, argument checks) and gemm_fp8.cu (CUDA, one cuBLASLt fp8 matmul;
// built only where cublasLt.h and libcublasLt are found, MPG_WITH_CUBLASLT).
//
// Y [M, N] = alpha * scale_a * scale_b * A B^T: A [M, K] and B [N, K] row-major fp8 (ONNX types
// 17 float8e4m3fn or 19 float8e5m2, not both 19), scale_a and scale_b one float32 each in device
// memory (the dequantisation multipliers, 1 / s), Y bfloat16. This is the "TN" layout cuBLASLt's
// fp8 GEMMs take on Hopper, the one com.microsoft.GemmFloat8 takes (transA=0, transB=1); unlike
// ORT's GemmFloat8 (1.31), which cudaMallocs and cudaFrees its workspace on every call, the
// handle, workspace and plans are kept, so a step of these can be captured in a CUDA graph.
#pragma once
#include <stddef.h>
#include <stdint.h>

struct GemmFp8Shape {
  int64_t m, n, k;
  float alpha;
  int type_a, type_b;  // ONNX element types: 17 float8e4m3fn, 19 float8e5m2
  bool bias;           // a bfloat16 [N] bias is added before the rounding
};

// 0 on success; otherwise nonzero, with a message from mpg_gemm_fp8_last_error(). ``bias``
// (bfloat16 [N], device memory) is nullptr unless shape->bias.
extern "C" int mpg_gemm_fp8_cuda(const GemmFp8Shape* shape, const void* a, const void* b, const float* scale_a,
                                 const float* scale_b, const void* bias, void* y, void* stream);
extern "C" const char* mpg_gemm_fp8_last_error();

// Y [cols, rows] = X [rows, cols]^T for one-byte elements (fp8 values moved as they are): the
// transposed operands the TN layout needs, cut from fp8 values the step has already (ORT's CUDA
// Transpose has no float8 kernel). 0 on success, else nonzero (mpg_gemm_fp8_last_error()).
extern "C" int mpg_transpose_bytes_cuda(const void* x, void* y, int64_t rows, int64_t cols, void* stream);

// *out = max |x[i]| over n elements of ONNX type ``type`` (1 float32, 10 float16, 16 bfloat16), as
// float32; a NaN wins (its bits are above infinity's), 0 for n = 0. One pass over x: the amax of a
// quantised tensor, which ReduceMax(Abs(x)) computes in two (Abs writing a float32 copy).
extern "C" int mpg_absmax_cuda(const void* x, int type, int64_t n, float* out, void* stream);

// q[i] = fp8(x[i] * *scale) for n elements: x of ONNX type ``type`` (1 float32, 10 float16, 16
// bfloat16), the product rounded to float32, then to fp8 type ``to`` (17 e4m3fn, 19 e5m2) nearest
// even with saturation (cuda_fp8.h's __NV_SATFINITE, ONNX's Cast saturate=1). With ``amax`` (device
// memory, else nullptr), also *amax = max |x[i]| as mpg_absmax_cuda computes it, in the same read.
extern "C" int mpg_cast_fp8_cuda(const void* x, int type, int64_t n, const float* scale, void* q, int to, float* amax,
                                 void* stream);

// mpg_cast_fp8_cuda with ``amax`` of x [rows, cols] (its leading dims flattened) and, in the same
// pass, qt [cols, rows] = q^T: the quantised operand one GemmFp8 reads as it is and another
// transposed (rule 9), where the cast and Fp8Transpose read x and q apart. Tiles of 64 x 64 where
// rows and cols are multiples of 4, else the cast and the byte transpose one after the other.
extern "C" int mpg_cast_transpose_fp8_cuda(const void* x, int type, int64_t rows, int64_t cols, const float* scale,
                                           void* q, void* qt, int to, float* amax, void* stream);
