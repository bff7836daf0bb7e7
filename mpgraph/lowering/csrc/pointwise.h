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
  int vector = 0;  // every full-size input and output 16-byte aligned: four elements a load
};

// One instruction's IEEE operation on a and b (b unused by the unary ones), in float32.
template <typename Round>
MPG_PW_HD float pw_apply(int op, float a, float b) {
  switch (op) {  // CUDA: the _rn intrinsics, never contracted into an FMA
#ifdef __CUDA_ARCH__
    case kPwAdd: return __fadd_rn(a, b);
    case kPwSub: return __fsub_rn(a, b);
    case kPwMul: return __fmul_rn(a, b);
    case kPwDiv: return __fdiv_rn(a, b);
    case kPwRcp: return __fdiv_rn(1.0f, a);
#else
    case kPwAdd: return a + b;
    case kPwSub: return a - b;
    case kPwMul: return a * b;
    case kPwDiv: return a / b;
    case kPwRcp: return 1.0f / a;
#endif
    case kPwSqrt: return Round::sqrt(a);
    case kPwNeg: return -a;
    case kPwAbs: return a < 0.0f ? -a : (a == 0.0f ? 0.0f : a);
    default: return a;  // kPwCvt
  }
}

// v rounded to ONNX dtype t and back (Round::bf16, Round::f16: to nearest even).
template <typename Round>
MPG_PW_HD float pw_round(int t, float v) {
  return t == 16 ? Round::bf16(v) : t == 10 ? Round::f16(v) : v;
}

// Runs the program over registers r.
template <typename Round>
MPG_PW_HD void pw_exec(const PwProgram& p, float* r) {
  for (int k = 0; k < p.count; ++k) {
    const PwInstr in = p.code[k];
    r[in.dst] = pw_round<Round>(in.t, pw_apply<Round>(in.op, r[in.a], in.b < kPwMaxRegisters ? r[in.b] : 0.0f));
  }
}

// The element index a mode reads for element i.
MPG_PW_HD int64_t pw_index(int mode, int64_t i, int64_t last) {
  return mode == kPwFull ? i : mode == kPwScalar ? 0 : i % last;
}
