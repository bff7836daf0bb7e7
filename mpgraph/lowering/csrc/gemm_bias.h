// A low-precision GEMM with a bias row in one matmul: the interface between kernels.cc (the
// GemmBias custom op, its CPU reference loop, argument checks) and gemm_bias.cu (CUDA, one
// cuBLASLt matmul with the CUBLASLT_EPILOGUE_BIAS epilogue; built only where cublasLt.h and
// libcublasLt are found, MPG_WITH_CUBLASLT).
//
// Y [M, N] = alpha * A' B' + bias, A' = A^T when trans_a ([K, M] stored) else A ([M, K]),
// B' = B^T when trans_b ([N, K]) else B ([K, N]); bias has N elements (an A of more dims, [..., K],
// without trans_a, is its M = product-of-leading-dims rows as they lie). All row-major and
// contiguous, one element type (float16 or bfloat16); the products accumulate in float32, the
// bias is added in float32, and the sum is rounded once to the element type.
#pragma once
#include <stddef.h>
#include <stdint.h>

struct GemmBiasShape {
  int64_t m, n, k;
  int trans_a, trans_b;
  float alpha;
  int type;  // ONNX element type: 10 float16 or 16 bfloat16
};

// GemmBiasGelu: with ``pre`` (not null), Y = gelu_tanh(alpha * A' B' + bias), the sum taken in
// float32 and GELU applied to it before the one rounding, and ``pre`` [M, N] = that sum rounded
// (what the GELU's backward reads): cuBLASLt's CUBLASLT_EPILOGUE_GELU_AUX_BIAS.
//
// 0 on success; otherwise nonzero, with a message from mpg_gemm_bias_last_error().
extern "C" int mpg_gemm_bias_cuda(const GemmBiasShape* shape, const void* a, const void* b, const void* bias, void* y,
                                  void* pre, void* stream);
extern "C" const char* mpg_gemm_bias_last_error();
