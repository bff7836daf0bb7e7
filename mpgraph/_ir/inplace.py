"""Which state outputs of a step graph may be written into their input's buffer.

A trainer binds each state input (a parameter, Adam's ``m`` and ``v``) to one device buffer
and its updated output to another, so a step holds the state twice. The output can share the
input's buffer (an in-place update, as PyTorch's optimizers do) when nothing can read the old
value after the new one is written. ``inplace_pairs`` proves that per pair ``(a, b)`` from the
graph, or says why not:

1. ``b`` is made by one node ``U`` (the update) of the main graph that reads ``a`` itself, at an
   input slot whose output slot is ``b``, element for element: an ONNX elementwise op
   (``ELEMENTWISE``: output element i is computed from input element i before it is written),
   or mpgraph's fused AdamW (``AdamWUpdate``, ``MultiAdamWUpdate``: each thread reads p, g, m
   and v of an element, then writes p', m' and v' of that element, ``lowering/csrc/adamw.cu``,
   ``multi.cu``, ``kernels.cc``). Or ``U`` does not read ``a`` at all (``p' = Sub(Mul(p, d), u)``).
2. Every other node that reads ``a``, or a view of it (``Identity``, ``Reshape``, ``Squeeze``,
   ``Unsqueeze``, ``Flatten``: ORT may alias their output to their input), is an ancestor of
   ``U``: ORT runs a node after all of its inputs are made, so each such reader has run before
   ``U`` writes, in any order ORT picks.
3. ``a`` and ``b`` have the same shape and dtype where the graph says (the buffer must fit).

State values of fewer than ``min_elements`` elements (the step counter, the loss scale) are
left out of both answers: sharing saves bytes, and a loss scale read back after a step must be
the one the step used.

Example: ``m' = Add(Mul(m, b1), g)`` qualifies (the ``Mul`` is ``Add``'s ancestor); a second
output ``norm = ReduceSum(m)`` that nothing of the update needs does not, since ORT may run it
after the ``Add``:

    >>> import onnx_ir as ir
    >>> f = ir.TensorType(ir.DataType.FLOAT)
    >>> m, g = ir.Value(name="m", type=f, shape=ir.Shape([4])), ir.Value(name="g", type=f, shape=ir.Shape([4]))
    >>> scaled = ir.node("Mul", [m, g], name="scale")
    >>> update = ir.node("Add", [scaled.outputs[0], g], name="update")
    >>> update.outputs[0].name = "m_new"
    >>> graph = ir.Graph([m, g], [update.outputs[0]], nodes=[scaled, update])
    >>> inplace_pairs(graph, [("m", "m_new")])
    (['m'], {})
    >>> norm = ir.node("ReduceSum", [m], name="norm")
    >>> graph.append(norm); graph.outputs.append(norm.outputs[0])
    >>> inplace_pairs(graph, [("m", "m_new")])[1]
    {'m': "node 'norm' (ReduceSum) reads it and may run after its update 'update' (Add)"}
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import onnx_ir as ir

__all__ = ["ELEMENTWISE", "inplace_pairs"]

#: ONNX ops whose every output element is computed from the same element of each input of the
#: output's shape, so the output may overwrite such an input.
ELEMENTWISE = frozenset({
    "Abs", "Add", "And", "Ceil", "Clip", "Cos", "Div", "Equal", "Erf", "Exp", "Floor", "Greater", "Less", "Log",
    "Max", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin",
    "Sqrt", "Sub", "Sum", "Tanh", "Where", "Xor",
})
_ONNX = ("", "ai.onnx")
_VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
#: mpgraph's fused optimizer ops (domain ``ai.mpgraph``): input slot -> the output slot it is
#: updated into; ``MultiAdamWUpdate`` repeats its four tensors after seven scalars.
_FUSED_DOMAIN = "ai.mpgraph"
_ADAMW_SLOTS = {0: 0, 2: 1, 3: 2}


def _output_slot(node: ir.Node, slot: int) -> int | None:
    """The output slot that input ``slot`` of ``node`` is updated into element for element."""
    if node.domain in _ONNX and node.op_type in ELEMENTWISE and len(node.outputs) == 1:
        return 0
    if node.domain == _FUSED_DOMAIN and node.op_type == "AdamWUpdate":
        return _ADAMW_SLOTS.get(slot)
    if node.domain == _FUSED_DOMAIN and node.op_type == "MultiAdamWUpdate" and slot >= 7:
        tensor, k = divmod(slot - 7, 4)
        return None if k not in _ADAMW_SLOTS else 3 * tensor + _ADAMW_SLOTS[k]
    return None


def _aliases(value: ir.Value) -> list[ir.Value]:
    """``value`` and every view of it (view ops, transitively)."""
    out, todo = [], [value]
    while todo:
        v = todo.pop()
        out.append(v)
        todo.extend(use.node.outputs[0] for use in v.uses()
                    if use.node.domain in _ONNX and use.node.op_type in _VIEWS and use.idx == 0 and use.node.outputs)
    return out


class _Ancestry:
    """Ancestor sets of the main graph's nodes, as bit masks over a topological order (the
    graph's own list need not be one)."""

    def __init__(self, graph: ir.Graph) -> None:
        nodes = {id(n) for n in graph}
        order: list[ir.Node] = []
        done: set[int] = set()
        for root in graph:
            stack = [(root, False)]
            while stack:
                node, leave = stack.pop()
                if leave:
                    order.append(node)
                elif id(node) not in done:
                    done.add(id(node))
                    stack.append((node, True))
                    stack.extend((p, False) for p in self._producers(node, nodes) if id(p) not in done)
        self.index = {id(n): i for i, n in enumerate(order)}
        self.mask: dict[int, int] = {}
        for node in order:
            mask = 0
            for p in self._producers(node, nodes):
                mask |= self.mask[id(p)] | (1 << self.index[id(p)])
            self.mask[id(node)] = mask

    @staticmethod
    def _producers(node: ir.Node, nodes: set[int]) -> list[ir.Node]:
        return [p for v in node.inputs if v is not None and (p := v.producer()) is not None and id(p) in nodes]

    def precedes(self, node: ir.Node, later: ir.Node) -> bool:
        """``node`` is an ancestor of ``later`` (ORT must run it first)."""
        return id(node) in self.index and bool((self.mask[id(later)] >> self.index[id(node)]) & 1)


def _describe(node: ir.Node) -> str:
    return f"'{node.name}' ({node.op_type})"


def _why_not(a: ir.Value, b: ir.Value, ancestry: _Ancestry) -> str:
    """Why ``b`` may not overwrite ``a`` ("" when it may)."""
    update = b.producer()
    if update is None or id(update) not in ancestry.index:
        return "its new value is not made by a node of the main graph"
    if a.dtype is not None and b.dtype is not None and a.dtype != b.dtype:
        return f"its new value is {b.dtype.name}, not {a.dtype.name}"
    if a.shape is not None and b.shape is not None and a.shape.is_static() and b.shape.is_static() \
            and tuple(a.shape) != tuple(b.shape):
        return f"its new value has shape {list(b.shape)}, not {list(a.shape)}"
    for v in _aliases(a):
        for use in v.uses():
            reader = use.node
            if reader is update:
                if v is not a:
                    return f"its update {_describe(update)} reads it through a view"
                if _output_slot(update, use.idx) != b.index():
                    return f"its update {_describe(update)} is not elementwise from it into its new value"
            elif id(reader) not in ancestry.index:
                return f"node {_describe(reader)} reads it inside a subgraph"
            elif not ancestry.precedes(reader, update):
                return f"node {_describe(reader)} reads it and may run after its update {_describe(update)}"
    return ""


def inplace_pairs(graph: ir.Graph, pairs: Iterable[tuple[str, str]], *,
                  min_elements: int = 2) -> tuple[list[str], dict[str, str]]:
    """The state inputs whose outputs may share their buffer (see the module), and why each
    other one may not (state input -> reason); inputs of a static shape with fewer than
    ``min_elements`` elements are in neither."""
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        for v in node.outputs:
            values.setdefault(v.name, v)
    ancestry = _Ancestry(graph)
    safe: list[str] = []
    refused: dict[str, str] = {}
    for a_name, b_name in pairs:
        a, b = values.get(a_name), values.get(b_name)
        if a is not None and a.shape is not None and a.shape.is_static() and math.prod(a.shape.numpy()) < min_elements:
            continue
        reason = "not in the graph" if a is None or b is None else _why_not(a, b, ancestry)
        if reason:
            refused[a_name] = reason
        else:
            safe.append(a_name)
    return safe, refused
