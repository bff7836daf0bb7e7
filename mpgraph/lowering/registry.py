"""Every lowering rule, in the order a session plan applies them.

A rule rewrites a session's copy of a step graph in place and says how many rewrites it made.
Each is registered here once, with:

- ``name``: what the plan records (``SessionPlan.applied``) and the docs cite;
- ``scope``: the narrowest ``lower`` scope that runs it. ``native`` rewrites onto ONNX
  Runtime's own ops and needs no library (it runs in every scope); ``default`` is in each
  provider's default; ``all`` runs on CPU only when everything is asked for (on CUDA the default
  is everything); ``deterministic`` runs only for a deterministic session
  (``PlanOptions.deterministic``), whatever the kernel scope;
- ``providers``: the execution providers it is for;
- ``exactness``: ``bit-identical`` (the same bits as the ops it replaces), ``same math`` (the
  same terms rounded the same way, summed in another order: equal within float32 rounding), or
  ``approximate`` (other arithmetic; none yet).

Adding a fusion is one rule module (a matcher over canonical ops with ``mpgraph.lowering.match``,
its kernel in ``csrc/``), one line in ``RULES`` and its test; ``docs/architecture.md`` walks
through one.

Example:
    >>> [r.name for r in RULES if r.runs("cpu", "default")]
    ['adamw', 'adam_scalars', 'multi_adamw', 'relu_grad', 'nchwc', 'permute']
    >>> next(r for r in RULES if r.name == "gelu").exactness
    <Exactness.SAME_MATH: 'same math'>
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import onnx_ir as ir

from mpgraph.lowering.attention import fuse_attention
from mpgraph.lowering.attention_expand import expand_attention
from mpgraph.lowering.cross_entropy import fuse_cross_entropy
from mpgraph.lowering.deterministic import one_hot_scatter, ones_matmul_sums
from mpgraph.lowering.fp8_gemm import lower_fp8_gemms
from mpgraph.lowering.free_early import free_early
from mpgraph.lowering.fuse import fuse_adamw, fuse_layernorm_grad
from mpgraph.lowering.gelu import fuse_gelu
from mpgraph.lowering.gemm_bias import (
    fuse_gemm_bias,
    fuse_gemm_bias_gelu,
    fuse_matmul_bias,
    gemm_bias_on_cuda,
)
from mpgraph.lowering.grads import fuse_relu_grad, fuse_sce_grad
from mpgraph.lowering.multi import batch_adamw, batch_casts, fuse_unscale
from mpgraph.lowering.narrow_pad import narrow_pads_on_cuda
from mpgraph.lowering.nchwc import to_nchwc
from mpgraph.lowering.pad_concat import pads_as_concat
from mpgraph.lowering.permute import fast_transposes
from mpgraph.lowering.pointwise import fuse_pointwise
from mpgraph.lowering.recompute import recompute_gelu, recompute_gelu_on, recompute_swiglu
from mpgraph.lowering.rmsnorm import fuse_rmsnorm_grad
from mpgraph.lowering.rotary import fuse_rotary
from mpgraph.lowering.scalars import fuse_adam_scalars
from mpgraph.lowering.sdpa_layout import read_heads_in_place
from mpgraph.lowering.softmax import fuse_softmax_grad
from mpgraph.lowering.swiglu import fuse_swiglu, fuse_swiglu_grad
from mpgraph.lowering.transpose import fold_scales, fold_transposes

__all__ = ["Exactness", "LoweringRule", "RULES", "SCOPES", "Target"]

#: What ``lower`` rewrites: ``all`` of it; each provider's ``default``, what the ``Trainer``
#: runs (everything on CUDA; on CPU what measured faster there: ORT's blocked convolutions,
#: the multi-tensor AdamW and its scalars, the Relu backward; the LayerNorm, GELU and softmax
#: CPU loops are there to test the CUDA kernels' arithmetic, not for speed); or only the
#: rewrites onto ONNX Runtime's own ops (``native``: on CPU the convolutions; no library).
SCOPES = ("all", "default", "native")

BOTH = frozenset({"cpu", "cuda"})
CPU = frozenset({"cpu"})
CUDA = frozenset({"cuda"})


class Exactness(str, Enum):
    BIT_IDENTICAL = "bit-identical"
    SAME_MATH = "same math"
    APPROXIMATE = "approximate"


@dataclass(frozen=True)
class Target:
    """What a rule may ask about the session it lowers for."""

    provider: str
    scope: str
    #: ORT CPU's NCHWc channel block (0: no blocked convolutions); the runtime measures it.
    nchwc_block: int = 0
    #: The kernel library has the CUDA fused attention (``MpgraphKernelsHaveSdpa``; cuDNN).
    sdpa: bool = False
    #: The kernel library has the CUDA GemmBias (``MpgraphKernelsHaveGemmBias``; cuBLASLt).
    gemm_bias: bool = False


@dataclass(frozen=True)
class LoweringRule:
    name: str
    scope: str
    providers: frozenset[str]
    exactness: Exactness
    apply: Callable[[ir.Model, Target], int]
    doc: str

    def runs(self, provider: str, scope: str) -> bool:
        """Whether ``lower(..., provider, scope)`` applies this rule."""
        if provider not in self.providers or self.scope == "deterministic":
            return False
        if self.scope == "native":
            return scope in SCOPES
        if scope == "all":
            return True
        if scope == "default":
            return self.scope == "default" or provider == "cuda"
        return False


BIT, SAME = Exactness.BIT_IDENTICAL, Exactness.SAME_MATH

#: The rules in the order they apply (later matchers see earlier rewrites: ``multi_adamw``
#: batches the nodes ``adamw`` made; ``permute`` moves the transposes ``nchwc`` wrote).
RULES: tuple[LoweringRule, ...] = (
    LoweringRule("fp8_gemm", "native", CUDA, Exactness.APPROXIMATE, lambda m, t: lower_fp8_gemms(m, library=t.gemm_bias),
                 "fp8 products (QuantizeFp8Pass) as cuBLASLt fp8 GEMMs, com.microsoft.GemmFloat8, or GemmFp8 where the "
                 "library has cuBLASLt (fp8_gemm.py)"),
    LoweringRule("pad_concat", "native", CUDA, BIT, lambda m, t: pads_as_concat(m),
                 "a constant Pad of a type ORT CUDA has no Pad kernel for (the int64 labels of a causal "
                 "LM's loss) as Concat with constant blocks, so no node is left on CPU (pad_concat.py)"),
    LoweringRule("sdpa", "all", BOTH, SAME,
                 lambda m, t: fuse_attention(m, t.provider) if t.provider == "cpu" or t.sdpa else 0,
                 "an Attention (no mask, cache or softcap) and its backward as SdpaForward/SdpaBackward: "
                 "the scores stay in the kernel (attention.py; CUDA: cuDNN via csrc/sdpa.cu, float16/bfloat16, "
                 "head dim a multiple of 8 up to 128; CPU: a float32 reference loop)"),
    LoweringRule("sdpa_layout", "all", BOTH, BIT, lambda m, t: read_heads_in_place(m),
                 "a fused attention whose tensors are transposed [B, S, H*D] projections reads and writes those "
                 "directly (3-D layout): no Transpose copies around SdpaForward/SdpaBackward (sdpa_layout.py)"),
    LoweringRule("rotary", "all", BOTH, Exactness.APPROXIMATE, lambda m, t: fuse_rotary(m, t.provider),
                 "an ONNX RotaryEmbedding (forward and its gradient's) as the library's one-pass kernel, MLAS's float "
                 "arithmetic with one rounding per output (rotary.py, csrc/rotary.cu; CPU: float32, ORT's bits)"),
    LoweringRule("attention_expand", "native", CUDA, SAME, lambda m, t: expand_attention(m) if t.provider == "cuda" else 0,
                 "an Attention sdpa left (float32, a mask, softcap, other head dims, no cuDNN) as its function body's "
                 "standard ops in the node's dtype, which ORT CUDA runs (attention_expand.py)"),
    LoweringRule("adamw", "default", BOTH, BIT, lambda m, t: fuse_adamw(m),
                 "a tensor's AdamW/Adam update (14 ops) as one AdamWUpdate (fuse.py, csrc/adamw.cu)"),
    LoweringRule("adam_scalars", "default", BOTH, BIT, lambda m, t: fuse_adam_scalars(m),
                 "the optimizer's float64 step-size arithmetic as one AdamScalars (scalars.py)"),
    LoweringRule("multi_adamw", "default", BOTH, BIT, lambda m, t: batch_adamw(m),
                 "AdamWUpdate nodes sharing their scalars as one MultiAdamWUpdate (multi.py, csrc/multi.cu)"),
    LoweringRule("layernorm_grad", "all", BOTH, SAME, lambda m, t: fuse_layernorm_grad(m),
                 "a float32 LayerNormalization's backward, found by its gradient block, as LayerNormGrad(Bias) "
                 "(fuse.py, csrc/layernorm.cu)"),
    LoweringRule("gelu", "all", BOTH, SAME, lambda m, t: fuse_gelu(m),
                 "a Gelu's backward, found by its gradient block, as ErfGeluGrad or TanhGeluGrad "
                 "(gelu.py, csrc/gelu.cu)"),
    LoweringRule("rmsnorm_grad", "all", BOTH, SAME, lambda m, t: fuse_rmsnorm_grad(m),
                 "a float32 RMSNormalization's backward, found by its gradient block, as RmsNormGrad "
                 "(rmsnorm.py, csrc/rmsnorm.cu)"),
    LoweringRule("swiglu_grad", "all", BOTH, SAME, lambda m, t: fuse_swiglu_grad(m),
                 "the backward of (a * Sigmoid(a)) * b (Llama's SwiGLU), found by its three gradient blocks, "
                 "as SwiGluGrad (swiglu.py, csrc/swiglu.cu)"),
    LoweringRule("swiglu", "all", BOTH, SAME, lambda m, t: fuse_swiglu(m),
                 "y = (a * Sigmoid(a)) * b as one SwiGlu(a, b) -> (y, s) where only the product reads a * s "
                 "(after swiglu_grad; s as ORT's CUDA Sigmoid computes it) (swiglu.py, csrc/swiglu.cu)"),
    LoweringRule("unscale", "all", BOTH, BIT, lambda m, t: fuse_unscale(m),
                 "loss scaling's unscale and finite check as one UnscaleGradients (multi.py)"),
    LoweringRule("multi_cast", "all", BOTH, BIT, lambda m, t: batch_casts(m),
                 "the master weights' casts as one CastToBFloat16/CastToFloat16 (multi.py)"),
    LoweringRule("fold_transposes", "all", BOTH, SAME, lambda m, t: fold_transposes(m, t.provider),
                 "transposes read by a matmul folded into FusedMatMul/Gemm flags (transpose.py)"),
    LoweringRule("softmax_grad", "all", BOTH, SAME, lambda m, t: fuse_softmax_grad(m),
                 "an attention Softmax's backward, found by its and O = P V's gradient blocks, as SoftmaxGradDot "
                 "(softmax.py, csrc/softmax.cu)"),
    LoweringRule("cross_entropy", "all", BOTH, SAME, lambda m, t: fuse_cross_entropy(m, t.provider),
                 "a SoftmaxCrossEntropyLoss over a low-precision (padded) GEMM's logits and its backward as "
                 "SoftmaxCrossEntropyRows/SoftmaxCrossEntropyRowsGrad: the logits read once each, no float32 copy, "
                 "dlogits in their dtype with zero padding columns; before sce_grad (cross_entropy.py, "
                 "csrc/cross_entropy.cu; CPU: float32 reference loops)"),
    LoweringRule("relu_grad", "default", BOTH, BIT, lambda m, t: fuse_relu_grad(m),
                 "a Relu's backward as ReluGrad (grads.py, csrc/grads.cu)"),
    LoweringRule("sce_grad", "default", CUDA, SAME, lambda m, t: fuse_sce_grad(m),
                 "the cross-entropy logits gradient as SoftmaxCrossEntropyGrad (grads.py; CUDA: "
                 "the kernel's expf is ORT's, ORT CPU's Exp is MLAS's own)"),
    LoweringRule("narrow_pad", "native", CUDA, BIT, lambda m, t: narrow_pads_on_cuda(m),
                 "a narrowing Cast of a zero Pad (a padded GEMM's columns' gradient that cross_entropy did not "
                 "take) runs before the Pad, so the padded copy is 2-byte, not float32; the narrow Pad as "
                 "pad_concat's Concat (narrow_pad.py; after cross_entropy, whose chain it would break)"),
    LoweringRule("nchwc", "native", CPU, SAME,
                 lambda m, t: to_nchwc(m, block=t.nchwc_block, phases=t.scope != "native"),
                 "trainable-weight convolutions on ORT CPU's NCHWc kernels; with the library, "
                 "strided ConvTranspose as a phase Conv (nchwc.py, slices_dw.py)"),
    LoweringRule("permute", "default", CPU, BIT, lambda m, t: fast_transposes(m),
                 "float32 transposes ORT CPU copies element by element onto Permute (permute.py)"),
    LoweringRule("fold_scales", "all", BOTH, BIT, lambda m, t: fold_scales(m, t.provider),
                 "multiplications by a power of two folded into a matmul's alpha (transpose.py; "
                 "exact outside float overflow/underflow)"),
    LoweringRule("gemm_bias", "all", BOTH, SAME,
                 lambda m, t: fuse_gemm_bias(m, aligned_only=t.provider == "cuda") if t.provider == "cpu" or (t.gemm_bias and gemm_bias_on_cuda()) else 0,
                 "a float16/bfloat16 Gemm with a bias row as GemmBias: one cuBLASLt matmul with the bias epilogue (CUDA: "
                 "leading dimensions multiples of 8; MPGRAPH_GEMM_BIAS=ort turns it off), "
                 "no BroadcastBiasKernel (gemm_bias.py, csrc/gemm_bias.cu; CPU: a float32-accumulating reference loop)"),
    LoweringRule("matmul_bias", "all", BOTH, Exactness.APPROXIMATE,
                 lambda m, t: fuse_matmul_bias(m, aligned_only=t.provider == "cuda") if t.provider == "cpu" or (t.gemm_bias and gemm_bias_on_cuda()) else 0,
                 "a float16/bfloat16 MatMul/FusedMatMul and the Add of a bias row read by nothing else as GemmBias "
                 "(BERT's and ViT's linear layers): one rounding instead of two (gemm_bias.py)"),
    LoweringRule("gemm_bias_gelu", "all", BOTH, Exactness.APPROXIMATE,
                 lambda m, t: fuse_gemm_bias_gelu(m, aligned_only=t.provider == "cuda") if t.provider == "cpu" or t.gemm_bias else 0,
                 "opt-in (MPGRAPH_GEMM_GELU=1): a GemmBias read by a tanh Gelu (through one Reshape) as GemmBiasGelu, "
                 "cuBLASLt's GELU_AUX_BIAS epilogue, the GELU input kept for the backward (gemm_bias.py)"),
    LoweringRule("pointwise", "all", BOTH, BIT, lambda m, t: fuse_pointwise(m, low=t.provider == "cuda"),
                 "each convex group of elementwise ops (Cast, Add, Sub, Mul, Neg, two-input Sum; float32 Div, "
                 "Sqrt, Reciprocal, Sum; Reshape views) the rules above left, as one Pointwise register program, "
                 "rounding after each op as the op does (CPU: float32 ops and Casts only); last, so it takes what "
                 "every other rule left (pointwise.py, csrc/pointwise.cu)"),
    LoweringRule("one_hot_scatter", "deterministic", CUDA, SAME, lambda m, t: one_hot_scatter(m),
                 "the embedding gradient's scatter-add as a one-hot Gemm (deterministic.py)"),
    LoweringRule("ones_matmul_sums", "deterministic", CUDA, SAME, lambda m, t: ones_matmul_sums(m),
                 "bias-gradient sums over leading axes as MatMuls with ones (deterministic.py)"),
    LoweringRule("recompute", "all", BOTH, BIT, lambda m, t: recompute_swiglu(m) + (recompute_gelu(m) if recompute_gelu_on() else 0),
                 "a forward SwiGlu's or Gelu's outputs the backward reads (a weight gradient's input; SwiGluGrad's s) "
                 "recomputed there from the inputs it keeps anyway, a Gelu (opt-in: MPGRAPH_RECOMPUTE_GELU=1) through its Flatten view so that ORT's CSE "
                 "keeps it: fewer bytes live through the backward (recompute.py; before free_early, which orders them)"),
    LoweringRule("free_early", "native", CUDA, BIT, lambda m, t: free_early(m),
                 "the nodes listed so that ORT's order runs each node that frees at least what it allocates "
                 "(a weight gradient's GEMM) as soon as it can, and a small last reader of a large buffer (a bias "
                 "gradient's ReduceSum) right after the buffer's other readers; the count is nodes moved; last, so it orders what "
                 "every other rule made (free_early.py)"),
)
