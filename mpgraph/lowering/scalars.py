"""Fuse Adam's per-step scalar arithmetic into ``AdamScalars`` (a session lowering).

``mpgraph.optim.adam`` computes the bias-corrected step size and ``sqrt(1 - beta2^t)`` in
float64, as torch does on Python floats: ten scalar ops (two Casts in, two Pows, two Subs, a
Div, a Sqrt, two Casts out), each a kernel launch on ORT CUDA, the same ten for a tiny MLP
(78 kernels a step) as for a GPT. ``AdamScalars(t, lr, beta1, beta2, one)`` computes both in
one launch with the same float64 operations, so the values are the same bits.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import DOMAIN, constant, producer, replace, single_reader

__all__ = ["fuse_adam_scalars"]

_F32, _F64 = ir.DataType.FLOAT, ir.DataType.DOUBLE


def _cast(value: ir.Value | None, to: ir.DataType, source: ir.DataType) -> ir.Node | None:
    node = producer(value, "Cast")
    if node is None or node.attributes["to"].as_int() != to or node.inputs[0] is None or node.inputs[0].dtype != source:
        return None
    return node


def _scalar64(value: ir.Value | None) -> float | None:
    array = constant(value)
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 and value.dtype == _F64 else None  # type: ignore[union-attr]


def _correction(sub: ir.Node | None, t64: ir.Value) -> tuple[ir.Value, ir.Value, ir.Node] | None:
    """``Sub(one, Pow(beta, t64))``: ``(one, beta, pow)``."""
    if sub is None:
        return None
    one, power = sub.inputs
    pow_node = producer(power, "Pow")
    if pow_node is None or pow_node.inputs[1] is not t64 or _scalar64(one) != 1.0 or _scalar64(pow_node.inputs[0]) is None:
        return None
    return one, pow_node.inputs[0], pow_node  # type: ignore[return-value]


def _match(div: ir.Node, outputs: set[ir.Value]) -> tuple | None:
    lr64, bc1 = div.inputs
    lr_cast = _cast(lr64, _F64, _F32)
    sub1 = producer(bc1, "Sub")
    pow1 = producer(sub1.inputs[1], "Pow") if sub1 is not None else None
    t64 = pow1.inputs[1] if pow1 is not None else None
    t_cast = _cast(t64, _F64, _F32)
    first = _correction(sub1, t64) if t_cast is not None else None  # type: ignore[arg-type]
    out_cast = single_reader(div.outputs[0], outputs)
    if lr_cast is None or first is None or out_cast is None or out_cast.op_type != "Cast" \
            or out_cast.attributes["to"].as_int() != _F32:
        return None
    pows = [u.node for u in t64.uses() if u.node is not pow1]  # type: ignore[union-attr]
    if len(pows) != 1 or pows[0].op_type != "Pow" or t64 in outputs:
        return None
    sub2 = single_reader(pows[0].outputs[0], outputs)
    second = _correction(sub2, t64) if sub2 is not None and sub2.op_type == "Sub" else None  # type: ignore[arg-type]
    sqrt = single_reader(sub2.outputs[0], outputs) if second is not None else None  # type: ignore[union-attr]
    sq_cast = single_reader(sqrt.outputs[0], outputs) if sqrt is not None and sqrt.op_type == "Sqrt" else None
    if second is None or sq_cast is None or sq_cast.op_type != "Cast" or sq_cast.attributes["to"].as_int() != _F32:
        return None
    if _scalar64(second[0]) != _scalar64(first[0]) or not all(single_reader(v, outputs) for v in (lr64, bc1, first[2].outputs[0])):
        return None
    nodes = [t_cast, first[2], sub1, pows[0], sub2, lr_cast, div, out_cast, sqrt, sq_cast]
    inputs = [t_cast.inputs[0], lr_cast.inputs[0], first[1], second[1], first[0]]  # type: ignore[union-attr]
    return inputs, nodes, out_cast.outputs[0], sq_cast.outputs[0]


def fuse_adam_scalars(model: ir.Model) -> int:
    """Fuse every matching Adam scalar block in ``model``'s main graph, in place; how many
    ``AdamScalars`` nodes were made."""
    graph = model.graph
    outputs = set(graph.outputs)
    fused = 0
    names: NameScope | None = None
    for div in [n for n in graph if n.op_type == "Div" and n.domain in ("", "ai.onnx")]:
        if div.graph is None or div.outputs[0].dtype != _F64:
            continue
        found = _match(div, outputs)
        if found is None:
            continue
        inputs, nodes, step_size, bc2_sqrt = found
        names = names or NameScope(graph)
        node = Rewrite(graph, div.name or "div", names=names).node(
            "AdamScalars", *inputs, name="AdamScalars", domain=DOMAIN, num_outputs=2, like=div)
        # Before the step size's Cast: every input is made by then.
        replace(graph, nodes, node, (step_size, bc2_sqrt), before=nodes[7])
        fused += 1
    if fused:
        graph.sort()
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
