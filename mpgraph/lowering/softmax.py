"""Fuse an attention softmax's backward into ``SoftmaxGradDot`` (a session lowering).

For ``P = Softmax(S)`` whose output feeds ``O = P V``, mpgraph's autodiff writes the backward
with ``sum_j dP_ij P_ij = sum_d dO_id O_id`` (a row sum over the head dim instead of the keys)::

    delta = Cast(ReduceSum(Mul(Cast(dO), Cast(O)), [-1], keepdims=1), T)
    dS = Mul(P, Reshape(Sub(Reshape(dP, [-1, keys]), Reshape(delta, [-1, 1]))))

(the Casts only when T is float16 or bfloat16). That is seven kernels per attention layer on
ORT CUDA, and a float32 copy of O kept from the forward; ``SoftmaxGradDot(dP, P, dO, O)`` is one
kernel, a warp per row. It rounds delta and each step to T as the ops do; only the order of
delta's float sum differs (the ops' ``ReduceSum`` has its own), so it agrees within rounding.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.lowering.match import consts, fuse_muls, one_reader

__all__ = ["fuse_softmax_grad"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type in op_types else None


def _reshape_to(value: ir.Value | None, p: ir.Value, tail: int | None) -> bool:
    """``value`` comes from a Reshape to ``[-1, tail]`` (``tail`` None: to ``Shape(p)``), or
    from no Reshape at all where it already has p's shape."""
    node = _producer(value, "Reshape")
    if node is None:
        return value is not None and tail is None and value.shape is not None and value.shape == p.shape
    target = node.inputs[1]
    dims = list(p.shape) if p.shape is not None else []
    static = all(isinstance(d, int) for d in dims)
    if tail is None:  # Shape(P), or the constant it folds to once shapes are fixed
        shape_of = _producer(target, "Shape")
        if shape_of is not None:
            return shape_of.inputs[0] is p and not shape_of.attributes
        return static and consts(target) == dims
    rows = int(np.prod(dims[:-1])) if static else -1
    return consts(target) in ([-1, tail], [rows, tail])


def _through(value: ir.Value | None, op_type: str, outputs: set[ir.Value], nodes: list[ir.Node]) -> ir.Value | None:
    """``value``'s source past an ``op_type`` node read only here (recorded in ``nodes``), or
    ``value`` itself when it has no such producer."""
    node = _producer(value, op_type)
    if node is None or value is None or not one_reader(value, outputs):
        return value
    nodes.append(node)
    return node.inputs[0]


def _is_pv(value: ir.Value | None, p: ir.Value) -> bool:
    """``value = P @ V``: a MatMul (or a FusedMatMul without transposes or scaling) of P."""
    node = _producer(value, "MatMul", "FusedMatMul")
    if node is None or node.inputs[0] is not p:
        return False
    trans_a, alpha = node.attributes.get("transA"), node.attributes.get("alpha")
    return (trans_a is None or trans_a.as_int() == 0) and (alpha is None or alpha.as_float() == 1.0)


def _match(mul: ir.Node, outputs: set[ir.Value]) -> tuple | None:
    """For ``dS = Mul(P, ...)``: ``([dP, P, dO, O], nodes)``."""
    for slot in (0, 1):
        p, rest = mul.inputs[slot], mul.inputs[1 - slot]
        softmax = _producer(p, "Softmax")
        if softmax is None or p is None or p.dtype not in _TYPES or rest is None or rest.dtype != p.dtype:
            continue
        axis = softmax.attributes.get("axis")
        if axis is not None and axis.as_int() not in (-1, len(p.shape or ()) - 1):
            continue
        keys = p.shape[-1] if p.shape is not None and len(p.shape) >= 2 else None
        if not isinstance(keys, int) or not _reshape_to(rest, p, None):
            continue
        nodes: list[ir.Node] = [mul]
        sub_out = _through(rest, "Reshape", outputs, nodes)
        sub = _producer(sub_out, "Sub")
        if sub is None or not one_reader(sub_out, outputs):  # type: ignore[arg-type]
            continue
        nodes.append(sub)
        if not _reshape_to(sub.inputs[0], p, keys) or not _reshape_to(sub.inputs[1], p, 1):
            continue
        dp = _through(sub.inputs[0], "Reshape", outputs, nodes)
        delta = _through(_through(sub.inputs[1], "Reshape", outputs, nodes), "Cast", outputs, nodes)
        reduce = _producer(delta, "ReduceSum")
        if dp is None or reduce is None or not one_reader(delta, outputs) or dp.dtype != p.dtype:  # type: ignore[arg-type]
            continue
        if dp.shape is None or len(dp.shape) != len(p.shape) or (isinstance(dp.shape[-1], int) and dp.shape[-1] != keys):  # type: ignore[arg-type]
            continue
        axes = consts(reduce.inputs[1]) if len(reduce.inputs) > 1 else None
        keep = reduce.attributes.get("keepdims")
        prod = _producer(reduce.inputs[0], "Mul")
        if axes != [-1] or (keep is not None and keep.as_int() != 1) or prod is None or not one_reader(reduce.inputs[0], outputs):  # type: ignore[arg-type]
            continue
        nodes += [reduce, prod]
        pair = [_through(v, "Cast", outputs, nodes) for v in prod.inputs]
        order = [i for i in (0, 1) if _is_pv(pair[i], p)]
        if len(order) != 1 or any(v is None or v.dtype != p.dtype for v in pair):
            continue
        o, do = pair[order[0]], pair[1 - order[0]]
        return [dp, p, do, o], nodes
    return None


def fuse_softmax_grad(model: ir.Model) -> int:
    """Fuse every matching attention softmax backward in ``model``'s main graph, in place; how
    many ``SoftmaxGradDot`` nodes were made."""
    return fuse_muls(model, _match, "SoftmaxGradDot")
