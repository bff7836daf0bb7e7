"""Fused kernels for ONNX Runtime, as a custom-op library mpgraph builds on first use.

ONNX Runtime runs one kernel per ONNX node and has no general elementwise fusion on CUDA: a
step graph's AdamW is 14 elementwise ops a tensor, a LayerNorm backward 11, a GELU 5 forward
and 6 backward. This package holds the C++/CUDA source of fused replacements (``csrc/``),
builds it with the machine's compiler (``build``), and rewrites a session's copy of a step
graph to use them and ORT's ``FusedMatMul`` (``lower``; the matchers are in ``fuse``,
``multi``, ``scalars``, ``gelu``, ``softmax``, ``grads`` and ``transpose``). The optimizer,
cast, unscale and Relu ops are bit-identical to the ops they replace; the others round every step as the
ops do but sum in their own order (equal within float32 rounding). The saved step graph keeps
its standard ops.

The ``Trainer`` does this by itself on CUDA (``kernels=None``); by hand:

Example:
    >>> import onnxruntime as ort
    >>> from mpgraph import lowering
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw")
    >>> lowering.lower(step)  # the packed slot's AdamW, its float64 scalars, each Relu's backward
    4
    >>> sorted({n.op_type for n in step.graph if n.domain == lowering.DOMAIN})
    ['AdamScalars', 'AdamWUpdate', 'ReluGrad']
    >>> options = ort.SessionOptions()
    >>> options.register_custom_ops_library(str(lowering.library("cpu")))  # built once, then cached
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import onnx_ir as ir

from mpgraph.lowering.build import KernelBuildError, build_library
from mpgraph.lowering.fuse import DOMAIN, fuse_adamw, fuse_layernorm_grad
from mpgraph.lowering.gelu import fuse_gelu
from mpgraph.lowering.grads import fuse_relu_grad, fuse_sce_grad
from mpgraph.lowering.multi import batch_adamw, batch_casts, fuse_unscale
from mpgraph.lowering.nchwc import to_nchwc
from mpgraph.lowering.permute import fast_transposes
from mpgraph.lowering.scalars import fuse_adam_scalars
from mpgraph.lowering.softmax import fuse_softmax_grad
from mpgraph.lowering.transpose import fold_scales, fold_transposes

__all__ = ["DOMAIN", "KernelBuildError", "library", "lower"]


@functools.cache
def library(provider: str) -> Path:
    """The kernel library for ``provider`` (``cpu`` or ``cuda``), built on first use.

    Raises:
        KernelBuildError: It cannot be built here.
    """
    path = build_library(cuda=provider == "cuda")
    lib = ctypes.CDLL(str(path))
    if provider == "cuda" and not lib.MpgraphKernelsHaveCuda():
        raise KernelBuildError(f"{path} was built without CUDA kernels")
    return path


#: What ``lower`` rewrites: ``all`` of it; each provider's ``default``, what the ``Trainer``
#: runs (everything on CUDA; on CPU what measured faster there: ORT's blocked convolutions,
#: the multi-tensor AdamW and its scalars, the Relu backward; the LayerNorm, GELU and softmax
#: CPU loops are there to test the CUDA kernels' arithmetic, not for speed); or only the
#: rewrites onto ONNX Runtime's own ops (``native``: on CPU the convolutions; no library).
SCOPES = ("all", "default", "native")


def lower(model: ir.Model, provider: str = "cpu", scope: str = "all") -> int:
    """Rewrite ``model`` in place to use the library's fused ops, ORT's ``FusedMatMul`` and on
    CPU ORT's blocked convolutions (for a session on ``provider``); how many rewrites it made
    (fused nodes made, nodes merged into a multi-tensor node, transposes folded, convolutions
    moved).

    The steps (``scope`` picks among them, see ``SCOPES``):

    - each tensor's AdamW update becomes one ``AdamWUpdate`` node, those that share their
      scalars one ``MultiAdamWUpdate``, and the scalars' float64 arithmetic one ``AdamScalars``;
    - each float32 LayerNorm backward one ``LayerNormGrad`` (``LayerNormGradBias`` with its bias
      gradient); each erf GELU and its backward ``ErfGelu``/``ErfGeluGrad``; an attention
      softmax's backward ``SoftmaxGradDot``; a Relu's backward ``ReluGrad``; on CUDA the
      cross-entropy logits gradient ``SoftmaxCrossEntropyGrad``;
    - loss scaling's unscale and check one ``UnscaleGradients``; the master weights' casts one
      ``CastToBFloat16``/``CastToFloat16``;
    - transposes that feed a matmul fold into it (``fold_transposes``), and so do
      multiplications by a power of two (``fold_scales``);
    - on CPU, convolutions whose weights are not constants run on ORT's NCHWc kernels
      (``nchwc.to_nchwc``; the library is not needed for this one), and the float32
      transposes ORT CPU copies element by element (its NCHWc filter reorders among them) run
      on ``Permute`` (``permute.fast_transposes``).
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    cpu = provider != "cuda"
    if scope == "native":
        return to_nchwc(model) if cpu else 0
    everything = scope == "all" or not cpu  # the CPU default leaves out what lost there
    fused = fuse_adamw(model) + fuse_adam_scalars(model) + batch_adamw(model)
    if everything:
        fused += fuse_layernorm_grad(model) + fuse_gelu(model) + fuse_unscale(model) + batch_casts(model)
        fused += fold_transposes(model, provider) + fuse_softmax_grad(model)
    fused += fuse_relu_grad(model)
    if not cpu:  # on CUDA the kernel's expf is ORT's; ORT CPU's Exp is MLAS's own
        fused += fuse_sce_grad(model)
    else:
        fused += to_nchwc(model, phases=True) + fast_transposes(model)
    return fused + (fold_scales(model, provider) if everything else 0)
