"""Lowering: a step graph in, a session plan out (fusions, shape specialisation, native kernels).

ONNX Runtime runs one kernel per ONNX node and has no general elementwise fusion on CUDA: a
step graph's AdamW is 14 elementwise ops a tensor, a LayerNorm backward 11, a GELU 5 forward
and 6 backward. This package holds the C++/CUDA source of fused replacements (``csrc/``),
builds it with the machine's compiler (``build``), and rewrites a session's copy of a step
graph to use them and ORT's ``FusedMatMul``. Every rewrite is a registered rule
(``registry.RULES``: name, scope, providers, exactness) over the shared matcher ``match``;
``plan_session`` is the one entry point the runtime calls (``plan``), ``lower`` applies the
rules of one scope to a model by hand. The saved step graph keeps its standard ops.

This package imports only the floor (``mpgraph._ir``, ``dtypes``, ``errors``, ``optypes``,
``io``), never onnxruntime: the runtime registers the library and measures what the rules
need to know of ORT (the NCHWc block) and passes it in ``PlanOptions``. By hand:

Example:
    >>> import onnxruntime as ort
    >>> from mpgraph import lowering
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw")
    >>> lowering.lower(step)  # the packed slot's AdamW, its float64 scalars, each Relu's backward, the loss, a chain
    6
    >>> sorted({n.op_type for n in step.graph if n.domain == lowering.DOMAIN})
    ['AdamScalars', 'AdamWUpdate', 'Pointwise', 'ReluGrad', 'SoftmaxCrossEntropyRows', 'SoftmaxCrossEntropyRowsGrad']
    >>> options = ort.SessionOptions()
    >>> options.register_custom_ops_library(str(lowering.library("cpu")))  # built once, then cached
"""

from __future__ import annotations

from mpgraph.lowering.build import KernelBuildError
from mpgraph.lowering.match import DOMAIN
from mpgraph.lowering.plan import PlanOptions, SessionPlan, library, lower, plan_session
from mpgraph.lowering.registry import RULES, SCOPES, Exactness, LoweringRule

__all__ = [
    "DOMAIN", "Exactness", "KernelBuildError", "LoweringRule", "PlanOptions", "RULES", "SCOPES",
    "SessionPlan", "library", "lower", "plan_session",
]
