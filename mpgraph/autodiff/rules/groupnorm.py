"""Gradient rules for InstanceNormalization and GroupNormalization.

torch exports ``nn.GroupNorm`` as ``Reshape -> InstanceNormalization -> Reshape -> Mul -> Add``
(diffusers UNets); the dynamo exporter and opset-18/21 models use ``GroupNormalization``. Both
normalize ``x`` of shape [N, C, ...] over groups of channels: viewed as ``xg`` of shape
[N, G, M], ``xhat = (xg - mean) / sqrt(var + eps)`` over the last axis (G = C for instance
norm). With ``d = dy * scale`` viewed the same way, the input gradient is the usual
``inv_std * (d - mean(d) - xhat * mean(d * xhat))``; the statistics are recomputed because
neither op outputs them.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register

__all__ = ["infer_group_norm_types"]

V = ir.Value
Ctx = GradContext


def _grouped_norm_grads(ctx: Ctx, dy: V, groups: int, per_group_affine: bool) -> tuple:
    """Gradients of ``scale * xhat + bias`` for ``groups`` groups (0: one per channel).

    ``per_group_affine``: scale and bias have one entry per group (GroupNormalization-18),
    else one per channel.
    """
    x, scale = ctx.input(0), ctx.input(1)
    rank = ctx.rank(x)
    to_groups = ctx.ints([0, groups, -1])  # 0 copies N (and C when groups is 0)
    last = ctx.ints([2])
    xg = ctx.op("Reshape", x, to_groups)
    centered = ctx.op("Sub", xg, ctx.op("ReduceMean", xg, last, keepdims=1))
    var = ctx.op("ReduceMean", ctx.op("Mul", centered, centered), last, keepdims=1)
    eps = ctx.scalar(ctx.attr("epsilon", 1e-5), x)
    inv_std = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, eps)))
    xhat_g = ctx.op("Mul", centered, inv_std)
    dy_g = ctx.op("Reshape", dy, to_groups)
    if per_group_affine:
        dxhat_g = ctx.op("Mul", dy_g, ctx.op("Reshape", scale, ctx.ints([-1, 1])))
        affine_axes, dy_a, xhat_a = ctx.ints([0, 2]), dy_g, xhat_g
    else:
        column = ctx.op("Reshape", scale, ctx.ints([-1] + [1] * (rank - 2)))
        dxhat_g = ctx.op("Reshape", ctx.op("Mul", dy, column), to_groups)
        affine_axes, dy_a = ctx.ints([0, *range(2, rank)]), dy
        xhat_a = ctx.op("Reshape", xhat_g, ctx.shape(x)) if ctx.needs(1) else xhat_g
    dx = None
    if ctx.needs(0):
        m1 = ctx.op("ReduceMean", dxhat_g, last, keepdims=1)
        m2 = ctx.op("ReduceMean", ctx.op("Mul", dxhat_g, xhat_g), last, keepdims=1)
        centered_grad = ctx.op("Sub", ctx.op("Sub", dxhat_g, m1), ctx.op("Mul", xhat_g, m2))
        dx = ctx.op("Reshape", ctx.op("Mul", inv_std, centered_grad), ctx.shape(x))
    dscale = ctx.op("ReduceSum", ctx.op("Mul", dy_a, xhat_a), affine_axes, keepdims=0) if ctx.needs(1) else None
    dbias = ctx.op("ReduceSum", dy_a, affine_axes, keepdims=0) if ctx.needs(2) else None
    return dx, dscale, dbias


@register("InstanceNormalization", opsets=(6, None))
def instance_norm(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return _grouped_norm_grads(ctx, dy, 0, per_group_affine=False)


@register("GroupNormalization", opsets=(18, 20))
def group_norm_18(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Opset 18: scale and bias have one entry per group."""
    return _grouped_norm_grads(ctx, dy, ctx.attr("num_groups"), per_group_affine=True)


@register("GroupNormalization", opsets=(21, None))
def group_norm_21(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Opset 21: scale and bias have one entry per channel."""
    return _grouped_norm_grads(ctx, dy, ctx.attr("num_groups"), per_group_affine=False)


def infer_group_norm_types(graph: ir.Graph) -> int:
    """Give untyped GroupNormalization outputs their typed input's dtype and shape; returns the count.

    ONNX shape inference leaves them untyped (the op is a context-dependent function with no
    inference function), and the autodiff driver treats an untyped value as non-float, which
    cuts every gradient path through the op. Alternate it with shape inference until it returns
    0: a GroupNormalization whose input is downstream of another one gets typed on a later round.
    """
    count = 0
    for node in graph:
        x, y = node.inputs[0] if node.inputs else None, node.outputs[0]
        if node.op_type == "GroupNormalization" and x is not None and x.dtype is not None and y.dtype is None:
            y.dtype, y.shape = x.dtype, x.shape
            count += 1
    return count
