"""Gradient rules for data movement: reshapes, transposes, concat/split, slicing, gathers, pads."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register
from mpgraph.errors import GradientError

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


def _reshape_back(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Reshape", dy, ctx.shape(ctx.input(0))),) + (None,) * (len(node.inputs) - 1)


for _op, _since in (("Reshape", 14), ("Flatten", 13), ("Squeeze", 13), ("Unsqueeze", 13)):
    register(_op, opsets=(_since, None))(_reshape_back)


@register("Transpose", opsets=(13, None))
def transpose(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    perm = ctx.attr("perm") or list(reversed(range(ctx.rank(ctx.input(0)))))
    return (ctx.op("Transpose", dy, perm=[int(i) for i in np.argsort(perm)]),)


@register("Concat", opsets=(13, None))
def concat(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    axis = ctx.attr("axis") % ctx.rank(ctx.input(0))
    sizes = ctx.op("Concat", *[ctx.shape(x, axis, axis + 1) for x in node.inputs], axis=0)
    return tuple(ctx.op_multi("Split", dy, sizes, axis=axis, num_outputs=len(node.inputs)))


@register("Split", opsets=(18, None))
def split(ctx: Ctx, node: ir.Node, *dys: V | None) -> tuple:
    parts = [d if d is not None else ctx.zeros_like(y) for d, y in zip(dys, node.outputs, strict=True)]
    return ctx.op("Concat", *parts, axis=ctx.attr("axis", 0)), None


@register("Slice", opsets=(13, None))
def slice_(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x, starts_v = ctx.input(0), ctx.input(1)
    axes_v = ctx.optional_input(3)
    steps_v = ctx.optional_input(4)
    starts, axes, steps = ctx.const_ints(starts_v), ctx.const_ints(axes_v), ctx.const_ints(steps_v)
    axes = axes if axes_v is not None else (list(range(len(starts))) if starts else None)
    if starts and axes is not None and all(s >= 0 for s in starts) and (steps_v is None or steps == [1] * len(starts)):
        begin = ctx.ints(starts)  # unit steps from known starts: a Pad with runtime end pads
        idx = ctx.ints(axes)
        grown = ctx.op("Sub", ctx.op("Gather", ctx.shape(x), idx), ctx.op("Gather", ctx.shape(dy), idx))
        pads = ctx.op("Concat", begin, ctx.op("Sub", grown, begin), axis=0)
        return (ctx.op("Pad", dy, pads, None, idx),) + (None,) * (len(node.inputs) - 1)
    # General case (negative or runtime starts, strides): scatter into the flat positions.
    positions = ctx.op("Slice", _flat_positions(ctx, x), *node.inputs[1:])
    return (_scatter_back(ctx, x, positions, dy),) + (None,) * (len(node.inputs) - 1)


@register("Gather", opsets=(13, None))
def gather(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Embedding-style gradient: ScatterND with reduction add (repeated indices accumulate)."""
    data, indices = ctx.input(0), ctx.input(1)
    rank, q = ctx.rank(data), ctx.rank(indices)
    axis = ctx.attr("axis", 0) % rank
    dim = ctx.op("Gather", ctx.shape(data), ctx.ints([axis]))
    negative = ctx.op("Less", indices, ctx.const(np.zeros((), dtype=ctx.np_dtype(indices))))
    wrapped = ctx.op("Where", negative, ctx.op("Add", indices, ctx.op("Cast", dim, to=indices.dtype)), indices)
    index = ctx.op("Unsqueeze", wrapped, ctx.ints([-1]))
    if axis == 0:
        return ctx.op("ScatterND", ctx.zeros_like(data), index, dy, reduction="add"), None
    data_perm = [axis, *range(axis), *range(axis + 1, rank)]
    dy_perm = [*range(axis, axis + q), *range(axis), *range(axis + q, rank - 1 + q)]
    moved = ctx.zeros_like(ctx.op("Transpose", data, perm=data_perm))
    scattered = ctx.op("ScatterND", moved, index, ctx.op("Transpose", dy, perm=dy_perm), reduction="add")
    return ctx.op("Transpose", scattered, perm=[int(i) for i in np.argsort(data_perm)]), None


def _scatter_back(ctx: Ctx, x: V, positions: V, dy: V) -> V:
    """Sum ``dy`` into the flat positions of ``x`` that produced each of its elements."""
    zeros = ctx.op("ConstantOfShape", ctx.op("Reshape", ctx.op("Size", x), ctx.ints([1])),
                   value=ir.tensor(np.zeros((1,), dtype=ctx.np_dtype(x))))
    minus1 = ctx.ints([-1])
    scattered = ctx.op("ScatterElements", zeros, ctx.op("Reshape", positions, minus1),
                       ctx.op("Reshape", dy, minus1), reduction="add")
    return ctx.op("Reshape", scattered, ctx.shape(x))


def _flat_positions(ctx: Ctx, x: V) -> V:
    """int64 tensor shaped like ``x`` holding each element's flat index."""
    flat = ctx.op("Range", ctx.const(np.int64(0)), ctx.op("Size", x), ctx.const(np.int64(1)))
    return ctx.op("Reshape", flat, ctx.shape(x))


@register("Pad", opsets=(18, None))
def pad(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """constant: slice the interior; reflect/edge/wrap: pad the element positions the same
    way and scatter-add the gradient back through them."""
    x, pads_v = ctx.input(0), ctx.input(1)
    mode, pads = ctx.attr("mode", "constant"), ctx.const_ints(pads_v)
    none = (None,) * (len(node.inputs) - 1)
    if mode != "constant":
        positions = ctx.op("Pad", _flat_positions(ctx, x), *node.inputs[1:2], None, *node.inputs[3:], mode=mode)
        return (_scatter_back(ctx, x, positions, dy),) + none
    if pads is None or any(p < 0 for p in pads):
        raise GradientError(
            f"no gradient for Pad node '{node.name}' with runtime or negative pads; "
            "constant pads >= 0 are differentiable"
        )
    axes_v = ctx.optional_input(3)
    axes = ctx.required_ints(axes_v, "Pad axes") if axes_v is not None else list(range(ctx.rank(x)))
    begin = ctx.ints(pads[: len(axes)])
    end = ctx.op("Add", begin, ctx.op("Gather", ctx.shape(x), ctx.ints(axes)))
    return (ctx.op("Slice", dy, begin, end, ctx.ints(axes)),) + none
