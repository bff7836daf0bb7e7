"""Fused kernels for ONNX Runtime, as a custom-op library mpgraph builds on first use.

ONNX has no op that updates a parameter and its Adam moments in one pass: mpgraph's AdamW is 14
elementwise ops a tensor, each a kernel that reads and writes parameter-sized memory. This
package holds the C++/CUDA source of fused replacements (``csrc/``), builds it with the
machine's compiler (``build``), and rewrites a session's copy of a step graph to use it
(``fuse``). ``AdamWUpdate`` is bit-identical to the ONNX ops it replaces; ``LayerNormGrad``
sums in its own order (equal within float32 rounding). The saved step graph keeps its
standard ops.

The ``Trainer`` does this by itself on CUDA (``kernels=None``); by hand:

Example:
    >>> import onnxruntime as ort
    >>> from mpgraph import kernels
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw")
    >>> kernels.lower(step)  # the packed slot's 14 ops become one AdamWUpdate node
    1
    >>> options = ort.SessionOptions()
    >>> options.register_custom_ops_library(str(kernels.library("cpu")))  # built once, then cached
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import onnx_ir as ir

from mpgraph.kernels.build import KernelBuildError, build_library
from mpgraph.kernels.fuse import DOMAIN, fuse_adamw, fuse_layernorm_grad

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


def lower(model: ir.Model) -> int:
    """Rewrite ``model`` in place to use the library's fused ops; how many nodes were fused."""
    return fuse_adamw(model) + fuse_layernorm_grad(model)
