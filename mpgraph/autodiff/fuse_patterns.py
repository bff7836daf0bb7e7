"""Forward patterns whose backward a gradient rule may skip.

**Masked softmax input**: ``Where(mask, -inf, s)`` (or ``Where(mask, s, -inf)``) whose only
forward consumers are ``Softmax`` nodes. Softmax outputs exactly 0 at ``-inf`` logits and its
backward ``y * (dy - sum(dy * y))`` is then exactly 0 there too, so the Where's backward, a
select over the whole attention tensor, passes ``dy`` through.

Multi-node forms an exporter writes for one op (the erf GELU, a decomposed LayerNorm) are not
recognised here: ``CanonicalizeOpsPass`` rewrites them into the standard op before
differentiating, and that op's own rule writes its backward.

Matchers only read the graph; they never modify it.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x")
    >>> masked_softmax_input(ir.Node("", "Where", [x, x, x])) is None
    True
"""

from __future__ import annotations

import math

import onnx_ir as ir

from mpgraph._ir.meta import NODE_ROLE, Role

__all__ = ["masked_softmax_input"]

def _const(value: ir.Value | None) -> float | None:
    """The value of a one-element float constant, else ``None``. A graph input is never a
    constant here, even with an initializer: it may be a trainable parameter."""
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    if array.size != 1 or array.dtype.kind != "f":
        return None
    return float(array.reshape(-1)[0])


def masked_softmax_input(node: ir.Node) -> int | None:
    """For ``Where(mask, -inf, s)`` or ``Where(mask, s, -inf)`` feeding only ``Softmax``
    nodes: the input slot of ``s``. Otherwise ``None``."""
    if node.op_type != "Where" or len(node.inputs) != 3:
        return None
    slot = 2 if _is_minus_inf(node.inputs[1]) else 1 if _is_minus_inf(node.inputs[2]) else None
    if slot is None:
        return None
    forward = [c for c in node.outputs[0].consumers() if c.metadata_props.get(NODE_ROLE) != Role.BACKWARD]
    if not forward or any(c.op_type != "Softmax" or c.domain not in ("", "ai.onnx") for c in forward):
        return None
    return slot


def _is_minus_inf(value: ir.Value | None) -> bool:
    got = _const(value)
    return got is not None and got == -math.inf
