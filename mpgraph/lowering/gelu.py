"""Fuse the erf GELU and its backward into ``ErfGelu`` / ``ErfGeluGrad`` (a session lowering).

The torch exporters write GELU as five elementwise ops, and mpgraph's autodiff rule
(``autodiff.rules.elementwise.erf_gelu_grad``) differentiates it with six more::

    s = Div(x, div); cdf = Mul(half, Add(Erf(s), one)); y = Mul(x, cdf)
    dx = Mul(dy, Add(cdf, Mul(Div(s, Exp(Mul(s, s))), k)))

On ORT CUDA that is eleven kernels per GELU over the MLP's widest activation (the bench GPT:
[8, 512, 4096] per layer). The fused forward reads x and writes y; the fused backward reads dy
and x and writes dx, recomputing s and cdf (so neither is kept between them). Each step rounds
to x's type as the separate ops' outputs do (constants, operand order and all), so on CUDA the
results equal the ops they replace, up to how ORT's kernels round (checked by
``benchmarks/kernels_check.py``). Operand order is free only where IEEE arithmetic commutes
(the Adds and Muls); ``Div(x, div)`` must be as written.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph.lowering.match import DOMAIN, constant, producer, readers, replace, single_reader

__all__ = ["fuse_gelu"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _scalar(value: ir.Value | None, dtype: ir.DataType) -> bool:
    array = constant(value)
    return array is not None and array.size == 1 and value.dtype == dtype  # type: ignore[union-attr]


def _split(node: ir.Node, value: ir.Value, dtype: ir.DataType) -> tuple[ir.Value, ir.Value] | None:
    """For a commutative binary ``node`` with a scalar constant operand: ``(other, constant)``."""
    a, b = node.inputs
    if a is None or b is None:
        return None
    if _scalar(b, dtype) and a is value:
        return a, b
    if _scalar(a, dtype) and b is value:
        return b, a
    return None




def _match_forward(y_mul: ir.Node, outputs: set[ir.Value]) -> tuple | None:
    """``y = Mul(x, cdf)``: ``(x, [div, one, half], s, cdf, nodes)``."""
    for slot in (0, 1):
        x, cdf = y_mul.inputs[slot], y_mul.inputs[1 - slot]
        if x is None or cdf is None or x.dtype not in _TYPES:
            continue
        half_mul = producer(cdf, "Mul")
        a = next((v for v in (half_mul.inputs if half_mul else ()) if not _scalar(v, x.dtype)), None)
        split = _split(half_mul, a, x.dtype) if half_mul is not None and a is not None else None
        add = producer(a, "Add") if split is not None else None
        e = next((v for v in (add.inputs if add else ()) if not _scalar(v, x.dtype)), None)
        add_split = _split(add, e, x.dtype) if add is not None and e is not None else None
        erf = producer(e, "Erf") if add_split is not None else None
        div = producer(erf.inputs[0], "Div") if erf is not None else None
        if div is None or div.inputs[0] is not x or not _scalar(div.inputs[1], x.dtype):
            continue
        s = div.outputs[0]
        if single_reader(e, outputs, "Add") is None or single_reader(a, outputs, "Mul") is None:  # type: ignore[arg-type]
            continue
        consts = [div.inputs[1], add_split[1], split[1]]  # type: ignore[index]
        return x, consts, s, cdf, [div, erf, add, half_mul, y_mul]
    return None


def _match_backward(s: ir.Value, cdf: ir.Value, x: ir.Value, outputs: set[ir.Value]) -> tuple | None:
    """The rule's ``dx`` from ``s`` and ``cdf``: ``(dy, k, nodes)``; the last node makes dx."""
    found = readers(s, outputs)
    if found is None or len(found) != 3:
        return None
    square = next((n for n in found if n.op_type == "Mul" and n.inputs[0] is s and n.inputs[1] is s), None)
    ratio = next((n for n in found if n.op_type == "Div" and n.inputs[0] is s), None)
    exp = single_reader(square.outputs[0], outputs, "Exp") if square is not None else None
    if exp is None or ratio is None or ratio.inputs[1] is not exp.outputs[0] or single_reader(exp.outputs[0], outputs, "Div") is None:
        return None
    k_mul = single_reader(ratio.outputs[0], outputs, "Mul")
    split = _split(k_mul, ratio.outputs[0], x.dtype) if k_mul is not None else None
    add = single_reader(k_mul.outputs[0], outputs, "Add") if split is not None else None  # type: ignore[union-attr]
    if add is None or {id(v) for v in add.inputs} != {id(cdf), id(k_mul.outputs[0])}:  # type: ignore[union-attr]
        return None
    dy_mul = single_reader(add.outputs[0], outputs, "Mul")
    if dy_mul is None:
        return None
    dy = dy_mul.inputs[1] if dy_mul.inputs[0] is add.outputs[0] else dy_mul.inputs[0]
    if dy is None or dy.dtype != x.dtype or dy is add.outputs[0]:
        return None
    return dy, split[1], [square, exp, ratio, k_mul, add, dy_mul]  # type: ignore[index]


def fuse_gelu(model: ir.Model) -> int:
    """Fuse every erf GELU (and its backward, where the graph has it) in ``model``'s main graph,
    in place; how many fused nodes were made."""
    graph = model.graph
    outputs = set(graph.outputs)
    fused = 0
    for y_mul in [n for n in graph if n.op_type == "Mul" and n.domain in ("", "ai.onnx")]:
        if y_mul.graph is None:
            continue
        forward = _match_forward(y_mul, outputs)
        if forward is None:
            continue
        x, consts, s, cdf, forward_nodes = forward
        backward = _match_backward(s, cdf, x, outputs)
        if backward is None and (len(s.uses()) != 1 or len(cdf.uses()) != 1):
            continue  # s or cdf is read elsewhere: keep the ops
        meta = dict(y_mul.metadata_props)
        if backward is not None:
            dy, k, backward_nodes = backward
            grad = ir.Node(DOMAIN, "ErfGeluGrad", [dy, x, *consts, k], name=f"{y_mul.name}/ErfGeluGrad",
                           metadata_props=dict(backward_nodes[-1].metadata_props))
            replace(graph, backward_nodes, grad, (backward_nodes[-1].outputs[0],), before=backward_nodes[-1])
            fused += 1
        node = ir.Node(DOMAIN, "ErfGelu", [x, *consts], name=f"{y_mul.name}/ErfGelu", metadata_props=meta)
        replace(graph, forward_nodes, node, (y_mul.outputs[0],), before=y_mul)
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
