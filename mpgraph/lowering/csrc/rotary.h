// ai.mpgraph.RotaryEmbedding's shape, shared by kernels.cc (CPU loop, argument checks) and
// rotary.cu (CUDA).
#pragma once
#include <stdint.h>

struct RotaryShape {
  int64_t seq;       // S
  int64_t heads;     // N
  int head;          // H, the row length
  int rdim;          // rotary_embedding_dim (H when the attribute is 0)
  int interleaved;   // pairs (2k, 2k + 1) instead of (k, k + rdim / 2)
  int bnsh;          // 4-D [B, N, S, H] input (rows (b, n, s)); 3-D [B, S, N * H] otherwise
  int cache_b1;      // no position_ids and caches [1, S, rdim / 2]: one cache for every batch row
  int neg_sin;       // rotate by -sin (the gradient's RotaryEmbedding(dy, cos, Neg(sin)))
};

extern "C" int mpg_rotary_cuda(int type, const void* x, const void* cos_cache, const void* sin_cache,
                               const int64_t* position_ids, void* y, RotaryShape shape, int64_t rows, void* stream);
