// The multi-tensor ops' batch description, shared by kernels.cc (CPU, argument checks) and
// multi.cu (CUDA).
#pragma once
#include <stddef.h>

// Tensors per CUDA launch (the table is a kernel argument, under CUDA's 4 KB limit) and the
// elements one block takes.
constexpr int kMaxTensors = 32;
constexpr int kChunk = 16384;

// Element types (ONNX TensorProto.DataType numbers), as in ort_abi.h.
enum { kTypeFloat = 1, kTypeFloat16 = 10, kTypeBFloat16 = 16 };

enum MultiOp { kMultiAdamW = 0, kMultiCastBFloat16 = 1, kMultiCastFloat16 = 2, kMultiUnscale = 3 };

struct MultiTensor {
  const void* in[4];  // AdamW: p, g, m, v; cast and unscale: x
  void* out[3];       // AdamW: p', m', v'; cast and unscale: y
  size_t n;
  int type;           // the element type of in[0] (unscale reads float, float16 or bfloat16)
};

struct MultiBatch {
  MultiTensor* tensors;
  int count;
  const float* scalars[7];  // AdamW: c1, b2, c2, bc2_sqrt, eps, step_size, decay; unscale: inv_scale
  bool* found;              // unscale: set when any unscaled entry is not finite
};

extern "C" int mpg_multi_cuda(int op, const MultiBatch* batch, void* stream);
