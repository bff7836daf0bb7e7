// The cuBLASLt handle (one per device) and workspace (one per device and stream) that GemmBias
// (gemm_bias.cu) and GemmFp8 (gemm_fp8.cu) share: one 32 MiB workspace a stream for both, made
// on first use outside any CUDA-graph capture (ORT runs a step once before it captures).
// Built only with cuBLASLt (MPG_WITH_CUBLASLT).
#pragma once
#ifdef MPG_WITH_CUBLASLT
#include <cublasLt.h>
#include <stddef.h>
#include <stdint.h>

#include <string>

// 32 MiB, what torch gives cuBLASLt on Hopper, so the heuristic may pick the same split-K kernels.
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

// 0 and the current device, its handle and the workspace of (device, ``stream``); otherwise
// the failing call's status, and ``*what`` names it.
int mpg_lt_context(void* stream, int* device, cublasLtHandle_t* handle, void** workspace, std::string* what);

// The heuristic's first algorithm for ``desc`` with A ``a``, B ``b`` and ``d`` as both C and D,
// within kLtWorkspaceBytes and, where ``aligns`` is given, the operands' alignments in bytes
// (A, B, C, D). 0, with ``*found`` whether there is one (a refused preference or no algorithm
// is "none"); otherwise the status of cublasLtMatmulPreferenceCreate.
int mpg_lt_first_algo(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                      cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, const uint32_t* aligns,
                      cublasLtMatmulAlgo_t* algo, bool* found);
#endif
