// Pointwise(x_1, ...) -> (y_1, ...): a group of elementwise ONNX ops (mpgraph/lowering/pointwise.py)
// as one register program, shared by the CPU loop (kernels.cc) and the CUDA kernel (pointwise.cu).
//
// Each element: the inputs are loaded as float32 (exact from float16/bfloat16) into registers
// 0.., each instruction computes in float32 and rounds to its op's output type (ONNX dtype t:
// 1 none, 10 float16, 16 bfloat16; nearest even), the output registers are stored in the
// outputs' types. An input is full size (n elements), one element, or a vector along the last
// axis (index i % last).
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define MPG_PW_HD __host__ __device__ __forceinline__
#else
#define MPG_PW_HD inline
#endif

enum { kPwMaxInputs = 12, kPwMaxOutputs = 8, kPwMaxProgram = 32, kPwMaxRegisters = 24 };
enum PwOp { kPwCvt = 0, kPwAdd, kPwSub, kPwMul, kPwDiv, kPwNeg, kPwAbs, kPwSqrt, kPwRcp };
enum PwMode { kPwFull = 0, kPwScalar = 1, kPwRow = 2 };

struct PwInstr {
  uint8_t op, dst, a, b, t;
};

struct PwProgram {
  int count = 0;  // instructions
  PwInstr code[kPwMaxProgram];
};

struct PwArgs {
  int inputs = 0, outputs = 0;
  const void* in[kPwMaxInputs];
  int in_type[kPwMaxInputs];
  int in_mode[kPwMaxInputs];
  void* out[kPwMaxOutputs];
  int out_type[kPwMaxOutputs];
  int out_reg[kPwMaxOutputs];
  int64_t n = 0, last = 1;
};

// Runs the program over registers r; Round::bf16 and Round::f16 round a float to that type
// and back.
template <typename Round>
MPG_PW_HD void pw_exec(const PwProgram& p, float* r) {
  for (int k = 0; k < p.count; ++k) {
    const PwInstr in = p.code[k];
    const float a = r[in.a], b = in.b < kPwMaxRegisters ? r[in.b] : 0.0f;
    float v;
    switch (in.op) {  // one IEEE operation each (CUDA: the _rn intrinsics, never contracted into an FMA)
#ifdef __CUDA_ARCH__
      case kPwAdd: v = __fadd_rn(a, b); break;
      case kPwSub: v = __fsub_rn(a, b); break;
      case kPwMul: v = __fmul_rn(a, b); break;
      case kPwDiv: v = __fdiv_rn(a, b); break;
      case kPwSqrt: v = __fsqrt_rn(a); break;
      case kPwRcp: v = __fdiv_rn(1.0f, a); break;
#else
      case kPwAdd: v = a + b; break;
      case kPwSub: v = a - b; break;
      case kPwMul: v = a * b; break;
      case kPwDiv: v = a / b; break;
      case kPwSqrt: v = Round::sqrt(a); break;
      case kPwRcp: v = 1.0f / a; break;
#endif
      case kPwNeg: v = -a; break;
      case kPwAbs: v = a < 0.0f ? -a : (a == 0.0f ? 0.0f : a); break;
      default: v = a; break;  // kPwCvt
    }
    r[in.dst] = in.t == 16 ? Round::bf16(v) : in.t == 10 ? Round::f16(v) : v;
  }
}

// The element index a mode reads for element i.
MPG_PW_HD int64_t pw_index(int mode, int64_t i, int64_t last) {
  return mode == kPwFull ? i : mode == kPwScalar ? 0 : i % last;
}
