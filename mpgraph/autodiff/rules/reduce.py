"""Gradient rules for ReduceSum, ReduceMean and ReduceMax (axes as a constant input)."""

from __future__ import annotations

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register
from mpgraph.errors import GradientError

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


def _keepdims_grad(ctx: Ctx, node: ir.Node, dy: V) -> tuple[V, list[int] | None]:
    """``dy`` reshaped to keepdims form, and the reduced axes (None: all, or a no-op)."""
    x = ctx.input(0)
    axes_in = ctx.optional_input(1)
    axes = ctx.const_ints(axes_in)
    if axes_in is not None and axes is None:
        raise GradientError(
            f"{node.op_type} node '{node.name}' has runtime axes; the gradient needs constant axes"
        )
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return dy, []
        return dy, None  # all axes: dy broadcasts as is
    rank = ctx.rank(x)
    axes = sorted(a % rank for a in axes)
    keep = dy if ctx.attr("keepdims", 1) else ctx.op("Unsqueeze", dy, ctx.ints(axes))
    return keep, axes


@register("ReduceSum", opsets=(13, None))
def reduce_sum(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    keep, _ = _keepdims_grad(ctx, node, dy)
    return ctx.op("Expand", keep, ctx.shape(ctx.input(0))), None


@register("ReduceMean", opsets=(18, None))
def reduce_mean(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    keep, axes = _keepdims_grad(ctx, node, dy)
    if axes == []:
        return dy, None
    spread = ctx.op("Expand", keep, ctx.shape(x))
    return ctx.op("Div", spread, ctx.count_ratio(x, node.outputs[0], x)), None


@register("ReduceMax", opsets=(18, None))
def reduce_max(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Ties share the gradient evenly (as ``torch.amax``)."""
    x, y = ctx.input(0), node.outputs[0]
    keep, axes = _keepdims_grad(ctx, node, dy)
    if axes == []:
        return dy, None
    y_keep = y if ctx.attr("keepdims", 1) or axes is None else ctx.op("Unsqueeze", y, ctx.ints(axes))
    hit = ctx.op("Cast", ctx.op("Equal", x, y_keep), to=x.dtype)
    all_axes = ctx.ints(axes if axes is not None else range(ctx.rank(x)))
    ties = ctx.op("ReduceSum", hit, all_axes, keepdims=1)
    return ctx.op("Mul", hit, ctx.op("Div", keep, ties)), None
