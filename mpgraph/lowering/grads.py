"""Fuse two small gradient chains every classifier has (a session lowering).

- ``fuse_relu_grad``: the Relu rule's ``Mul(dy, Cast(Greater(x, 0)))`` (three kernels) becomes
  ``ReluGrad(dy, x)``: one pass, the same bits (``dy * 1`` and ``dy * 0`` as the Mul computes).
- ``fuse_sce_grad``: the SoftmaxCrossEntropyLoss rule's logits gradient
  ``Mul(Sub(Exp(log_prob), OneHot(index, depth, [0, 1], axis=1)), scale)`` (four passes over
  the ``[rows, classes]`` logits; the bench GPT's are [4096, 8192] float32) becomes
  ``SoftmaxCrossEntropyGrad(log_prob, index, scale)``: one pass, each operation rounded as the
  ops round it. The small per-row nodes that make ``index`` and ``scale`` (ignore_index, the
  mean's count) stay as they are.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.lowering.match import constant, fuse_muls, one_reader, producer

__all__ = ["fuse_relu_grad", "fuse_sce_grad"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _relu_match(mul: ir.Node, outputs: set[ir.Value]) -> tuple | None:
    for slot in (0, 1):
        dy, mask = mul.inputs[slot], mul.inputs[1 - slot]
        cast = producer(mask, "Cast")
        greater = producer(cast.inputs[0], "Greater") if cast is not None else None
        if greater is None or dy is None or dy.dtype not in _TYPES or mask.dtype != dy.dtype:  # type: ignore[union-attr]
            continue
        x, zero = greater.inputs
        zero_value = constant(zero)
        if x is None or x.dtype != dy.dtype or zero_value is None or zero_value.size != 1 or float(zero_value.reshape(-1)[0]) != 0:
            continue
        if not one_reader(mask, outputs) or not one_reader(greater.outputs[0], outputs):  # type: ignore[arg-type]
            continue
        return [dy, x], [mul, cast, greater]
    return None


def fuse_relu_grad(model: ir.Model) -> int:
    """Fuse every matching Relu backward in ``model``'s main graph, in place; how many
    ``ReluGrad`` nodes were made."""
    return fuse_muls(model, _relu_match, "ReluGrad")


def _is_depth(depth: ir.Value | None, log_prob: ir.Value) -> bool:
    """``depth`` is log_prob's class count: a constant equal to its static dim 1, or
    ``Shape(log_prob, start=1, end=2)`` (what the rule writes)."""
    value = constant(depth)
    if value is not None:
        return value.size == 1 and int(value.reshape(-1)[0]) == log_prob.shape[1]  # type: ignore[index]
    shape = producer(depth, "Shape")
    if shape is None or shape.inputs[0] is not log_prob:
        return False
    start, end = shape.attributes.get("start"), shape.attributes.get("end")
    return start is not None and start.as_int() == 1 and end is not None and end.as_int() == 2


def _sce_match(mul: ir.Node, outputs: set[ir.Value]) -> tuple | None:
    sub_out, scale = mul.inputs
    sub = producer(sub_out, "Sub")
    if sub is None or scale is None or scale.dtype != ir.DataType.FLOAT or not one_reader(sub_out, outputs):  # type: ignore[arg-type]
        return None
    exp, one_hot = producer(sub.inputs[0], "Exp"), producer(sub.inputs[1], "OneHot")
    if exp is None or one_hot is None or not one_reader(sub.inputs[0], outputs) or not one_reader(sub.inputs[1], outputs):  # type: ignore[arg-type]
        return None
    log_prob, index = exp.inputs[0], one_hot.inputs[0]
    on_off = constant(one_hot.inputs[2])
    axis = one_hot.attributes.get("axis")
    if log_prob is None or index is None or log_prob.dtype != ir.DataType.FLOAT or index.dtype != ir.DataType.INT64:
        return None
    if log_prob.shape is None or len(log_prob.shape) != 2 or axis is None or axis.as_int() not in (1, -1):
        return None
    if on_off is None or not np.array_equal(on_off.reshape(-1), [0.0, 1.0]) or not _is_depth(one_hot.inputs[1], log_prob):
        return None
    rows = log_prob.shape[0]
    scale_shape = list(scale.shape) if scale.shape is not None else None
    if scale_shape is None or not (scale_shape in ([], [1], [1, 1]) or (scale_shape[-1] == 1 and len(scale_shape) == 2)
                                   or (len(scale_shape) == 1 and scale_shape[0] == rows)):
        return None
    return [log_prob, index, scale], [mul, sub, exp, one_hot]


def fuse_sce_grad(model: ir.Model) -> int:
    """Fuse every matching softmax cross-entropy logits gradient in ``model``'s main graph, in
    place; how many ``SoftmaxCrossEntropyGrad`` nodes were made."""
    return fuse_muls(model, _sce_match, "SoftmaxCrossEntropyGrad")
