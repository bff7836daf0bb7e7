"""Gradient rule registry: one rule per (domain, op, opset range), looked up per node.

A rule is a function ``rule(ctx, node, *dys) -> sequence of input gradients`` (``None`` where an
input gets no gradient). It reads like the math; the driver (``driver.py``) owns fan-in sums,
un-broadcasting, pruning and naming.

Example:
    >>> from mpgraph.autodiff.registry import lookup_rule
    >>> lookup_rule("", "Relu", 18).op_type
    'Relu'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from mpgraph.errors import GradientError

__all__ = [
    "GradientRule",
    "NON_DIFFERENTIABLE",
    "register",
    "non_differentiable",
    "lookup_rule",
    "is_non_differentiable",
    "registered_rules",
]

RuleFn = Callable[..., Sequence[Any]]

#: Sentinel returned by ``lookup_rule`` for ops declared non-differentiable.
NON_DIFFERENTIABLE = "non-differentiable"


@dataclasses.dataclass(frozen=True)
class GradientRule:
    """One registered gradient rule.

    Attributes:
        domain: ONNX domain ("" is the default ``ai.onnx`` domain).
        op_type: ONNX op type.
        since: First opset version the rule applies to.
        until: Last opset version (inclusive) or ``None`` for open-ended.
        fn: The rule function ``fn(ctx, node, *dys)``.
        broadcast: When true, the driver un-broadcasts each returned gradient from the shape
            of the node's first output to the shape of the input it belongs to.
        outputs: Number of forward outputs the rule needs (the driver adds optional outputs
            such as a Dropout mask or MaxPool indices before differentiating).
    """

    domain: str
    op_type: str
    since: int
    until: int | None
    fn: RuleFn
    broadcast: bool = False
    outputs: int = 0

    def covers(self, opset: int) -> bool:
        """Whether the rule applies to ``opset``."""
        return self.since <= opset and (self.until is None or opset <= self.until)

    @property
    def key(self) -> str:
        """Stable identifier ``domain::Op@since-until`` used by the test coverage table."""
        until = "" if self.until is None else str(self.until)
        return f"{self.domain or 'ai.onnx'}::{self.op_type}@{self.since}-{until}"


_RULES: dict[tuple[str, str], list[GradientRule]] = {}
_NON_DIFF: dict[tuple[str, str], str] = {}


def register(
    op_type: str,
    *,
    domain: str = "",
    opsets: tuple[int, int | None] = (1, None),
    broadcast: bool = False,
    outputs: int = 0,
) -> Callable[[RuleFn], RuleFn]:
    """Register a gradient rule (decorator).

    Args:
        op_type: ONNX op type.
        domain: ONNX domain.
        opsets: Inclusive ``(since, until)`` opset range; ``until=None`` is open-ended.
        broadcast: Let the driver un-broadcast the returned gradients (elementwise ops).
        outputs: Forward outputs the rule needs (optional outputs are added by the driver).

    Returns:
        The decorator, which returns the function unchanged.
    """

    def deco(fn: RuleFn) -> RuleFn:
        rule = GradientRule(domain, op_type, opsets[0], opsets[1], fn, broadcast, outputs)
        existing = _RULES.setdefault((domain, op_type), [])
        for other in existing:
            lo, hi = max(other.since, rule.since), min(other.until or 10**6, rule.until or 10**6)
            if lo <= hi:
                raise AssertionError(f"overlapping gradient rules for {rule.key} and {other.key}")
        existing.append(rule)
        return fn

    return deco


def non_differentiable(*op_types: str, domain: str = "", reason: str = "") -> None:
    """Declare ops whose outputs carry no gradient (shape queries, comparisons, indices).

    Args:
        *op_types: ONNX op types.
        domain: ONNX domain.
        reason: Why, in words (kept for error messages and docs).
    """
    for op in op_types:
        _NON_DIFF[(domain, op)] = reason or "integer, boolean or piecewise-constant output"


def is_non_differentiable(domain: str, op_type: str) -> bool:
    """Whether ``op_type`` was declared non-differentiable."""
    return (_normalize(domain), op_type) in _NON_DIFF


def _normalize(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def lookup_rule(
    domain: str, op_type: str, opset: int, node_name: str = "?"
) -> GradientRule | str:
    """Find the rule for an op at an opset version.

    Args:
        domain: ONNX domain of the node.
        op_type: ONNX op type of the node.
        opset: Opset version of the node's domain in the model.
        node_name: Node name, for the error message.

    Returns:
        The rule, or ``NON_DIFFERENTIABLE`` for ops declared non-differentiable.

    Raises:
        GradientError: No rule covers the op at this opset.
    """
    domain = _normalize(domain)
    if (domain, op_type) in _NON_DIFF:
        return NON_DIFFERENTIABLE
    for rule in _RULES.get((domain, op_type), ()):
        if rule.covers(opset):
            return rule
    known = ", ".join(r.key for r in _RULES.get((domain, op_type), ())) or "none"
    raise GradientError(
        f"no gradient rule for op {domain or 'ai.onnx'}::{op_type} at opset {opset} "
        f"(node '{node_name}'; rules registered: {known}); freeze the parameters that feed it "
        "or add a rule in mpgraph/autodiff/rules"
    )


def registered_rules() -> list[GradientRule]:
    """All registered rules, sorted by key."""
    return sorted((r for rules in _RULES.values() for r in rules), key=lambda r: r.key)
