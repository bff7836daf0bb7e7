// Fused scaled dot-product attention, forward and backward: the interface between kernels.cc
// (the SdpaForward/SdpaBackward custom ops, their CPU reference loops, argument checks) and
// sdpa.cu (CUDA, through cuDNN's fused attention graphs via cudnn-frontend; built only when the
// cudnn and cudnn-frontend headers are found, MPG_WITH_CUDNN).
//
// Tensors are addressed as [batch, heads, sequence, head dim] through element strides, so the
// 4-D layout [B, H, S, D] and the 3-D one [B, S, H * D] of ONNX Attention are both read and
// written in place. Stats is float32 [B, Hq, Sq, 1], contiguous: per query row, the natural-log
// log-sum-exp of its scaled (and causally masked) scores, which the backward reads instead of
// the [Sq, Skv] probabilities.
#pragma once
#include <stddef.h>
#include <stdint.h>

struct SdpaShape {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, head_dim, v_head_dim;
  // Element strides of dims (batch, head, sequence, head dim) of Q, K, V and of Y (dY, dQ, dK
  // and dV are laid out as Y, Q, K and V).
  int64_t q_stride[4], k_stride[4], v_stride[4], y_stride[4];
  int type;     // ONNX element type of Q, K, V, Y: 10 float16 or 16 bfloat16 (CUDA)
  int causal;   // query i sees keys j <= i (top-left aligned, ONNX Attention's is_causal)
  float scale;  // multiplies Q K^T
};

// 0 on success; otherwise nonzero, with a message from mpg_sdpa_last_error().
extern "C" int mpg_sdpa_forward_cuda(const SdpaShape* shape, const void* q, const void* k, const void* v, void* y,
                                     float* stats, void* stream);
extern "C" int mpg_sdpa_backward_cuda(const SdpaShape* shape, const void* q, const void* k, const void* v,
                                      const void* y, const void* dy, const float* stats, void* dq, void* dk, void* dv,
                                      void* stream);
extern "C" const char* mpg_sdpa_last_error();
