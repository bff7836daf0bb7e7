"""Reverse-mode automatic differentiation over onnx-ir graphs.

``differentiate`` appends the backward pass of a loss to a graph; gradient rules live in
``rules/`` (one per op, registered with ``register``), non-differentiable ops are declared with
``non_differentiable``.
"""

from mpgraph.autodiff import rules as _rules  # noqa: F401  (registers every rule)
from mpgraph.autodiff.driver import GradContext, differentiate
from mpgraph.autodiff.registry import (
    GradientRule,
    lookup_rule,
    non_differentiable,
    register,
    registered_rules,
)

__all__ = [
    "GradContext",
    "GradientRule",
    "differentiate",
    "lookup_rule",
    "non_differentiable",
    "register",
    "registered_rules",
]
