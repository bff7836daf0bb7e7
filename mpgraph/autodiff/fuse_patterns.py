"""Multi-node forward patterns whose backward a gradient rule writes in one piece.

Exporters decompose some ops into several elementwise nodes. Differentiated node by node, each
piece gets its own rule and the backward pays for every intermediate tensor. The matchers here
let the rule of a pattern's *last* node recognise the whole pattern and emit one compact
backward; it then returns no gradient for the pattern's interior, so the interior rules never
run. That stays exact when interior values have other consumers: their contributions still
reach the interior rules through the driver's fan-in.

1. **Erf GELU** (torch's export below opset 20): ``y = x * (0.5 * (1 + erf(x / sqrt(2))))``,
   the operands of each Mul/Add in either order, ``x / sqrt(2)`` as ``Div`` or as ``Mul`` by
   ``1/sqrt(2)``. Node by node its backward is 10 nodes (5 rules and a fan-in Sum); the
   compact one is 6 (``mpgraph.autodiff.rules.elementwise.erf_gelu_grad``).
   The torchscript exporter groups it as ``y = (x * (erf(x / sqrt(2)) + 1)) * 0.5``: there the
   pattern is the inner product ``x * (1 + erf(x / sqrt(2)))`` (``match_erf_gelu_product``),
   whose derivative is ``(1 + erf(s)) + 2 s exp(-s^2) / sqrt(pi)``; the outer ``* 0.5`` keeps
   its own one-node rule. 7 nodes instead of 9 (the fan-in Sum for x included).
2. **Masked softmax input**: ``Where(mask, -inf, s)`` (or ``Where(mask, s, -inf)``) whose
   only forward consumers are ``Softmax`` nodes. Softmax outputs exactly 0 at ``-inf``
   logits and its backward ``y * (dy - sum(dy * y))`` is then exactly 0 there too, so the
   Where's backward, a select over the whole attention tensor, passes ``dy`` through.

Matchers only read the graph; they never modify it.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x")
    >>> match_erf_gelu(ir.Node("", "Mul", [x, x])) is None
    True
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from mpgraph._ir.meta import NODE_ROLE, Role

__all__ = ["ErfGelu", "match_erf_gelu", "match_erf_gelu_product", "masked_softmax_input"]

# Constants written by exporters are float32: compare with a float32-sized tolerance.
_RTOL = 1e-6


@dataclasses.dataclass(frozen=True)
class ErfGelu:
    """A matched erf GELU ending at a ``Mul`` node.

    Attributes:
        x: The GELU input.
        x_slot: Input index of ``x`` on the final Mul (the other slot holds ``cdf``).
        scaled: The forward value ``x / sqrt(2)``.
        cdf: The forward value ``0.5 * (1 + erf(x / sqrt(2)))``, the normal CDF of ``x``; for
            ``match_erf_gelu_product``, ``1 + erf(x / sqrt(2))`` (twice the CDF).
        tail: The coefficient of ``s * exp(-s^2)`` in the derivative: ``1/sqrt(pi)``, or
            ``2/sqrt(pi)`` for the product form.
    """

    x: ir.Value
    x_slot: int
    scaled: ir.Value
    cdf: ir.Value
    tail: float = 1.0 / math.sqrt(math.pi)


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


def _is(value: ir.Value | None, expected: float) -> bool:
    got = _const(value)
    return got is not None and math.isclose(got, expected, rel_tol=_RTOL)


def _split_const(node: ir.Node, expected: float) -> ir.Value | None:
    """For a binary node with one constant operand equal to ``expected``: the other operand."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if _is(b, expected):
        return a
    if _is(a, expected):
        return b
    return None


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _erf_argument(scaled: ir.Value) -> ir.Value | None:
    """``x`` when ``scaled`` is ``x / sqrt(2)`` (a Div, or a Mul by ``1/sqrt(2)``)."""
    node = scaled.producer()
    if node is None or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    if node.op_type == "Div" and _is(node.inputs[1], math.sqrt(2.0)):
        return node.inputs[0]
    if node.op_type == "Mul":
        return _split_const(node, math.sqrt(0.5))
    return None


def _erf_of_one_plus(value: ir.Value | None) -> ir.Node | None:
    """The ``Erf`` node when ``value`` is ``Add(Erf(s), 1)`` (either order), else ``None``."""
    add = _producer(value, "Add")
    erf = _producer(_split_const(add, 1.0), "Erf") if add is not None else None
    return erf if erf is not None and erf.inputs[0] is not None else None


def match_erf_gelu(node: ir.Node) -> ErfGelu | None:
    """The erf GELU ending at ``node`` (a ``Mul``), or ``None`` when it is not one."""
    if node.op_type != "Mul" or len(node.inputs) != 2 or None in node.inputs:
        return None
    for x_slot in (0, 1):
        x, cdf = node.inputs[x_slot], node.inputs[1 - x_slot]
        half = _producer(cdf, "Mul")
        erf = _erf_of_one_plus(_split_const(half, 0.5) if half is not None else None)
        if erf is None:
            continue
        scaled = erf.inputs[0]
        if _erf_argument(scaled) is x:
            assert x is not None and cdf is not None
            return ErfGelu(x=x, x_slot=x_slot, scaled=scaled, cdf=cdf)
    return None


def match_erf_gelu_product(node: ir.Node) -> ErfGelu | None:
    """``x * (1 + erf(x / sqrt(2)))`` ending at ``node`` (a ``Mul``; the torchscript GELU's
    inner product), or ``None`` when it is not one."""
    if node.op_type != "Mul" or len(node.inputs) != 2 or None in node.inputs:
        return None
    for x_slot in (0, 1):
        x, one_plus = node.inputs[x_slot], node.inputs[1 - x_slot]
        erf = _erf_of_one_plus(one_plus)
        if erf is None:
            continue
        if _erf_argument(erf.inputs[0]) is x:
            assert x is not None and one_plus is not None
            return ErfGelu(x=x, x_slot=x_slot, scaled=erf.inputs[0], cdf=one_plus, tail=2.0 / math.sqrt(math.pi))
    return None


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
