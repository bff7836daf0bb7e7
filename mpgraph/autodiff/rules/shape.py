"""Gradient rules for data movement: reshapes, transposes, concat/split, slicing, gathers, pads."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register

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
    """Unit steps: Pad ``dy`` back to ``x`` with the clamped starts as leading pads (starts
    known >= 0 and in range stay constants; negative, out-of-range or runtime starts are
    wrapped and clamped at run time, as Slice does). Other steps: scatter-add through the
    sliced element positions."""
    x, starts_v = ctx.input(0), ctx.input(1)
    axes_v, steps_v = ctx.optional_input(3), ctx.optional_input(4)
    none = (None,) * (len(node.inputs) - 1)
    starts = ctx.const_ints(starts_v)
    count = len(starts) if starts is not None else (ctx.dims(starts_v) or [None])[0]
    axes = ctx.const_ints(axes_v) if axes_v is not None else (list(range(count)) if count is not None else None)
    steps = ctx.const_ints(steps_v) if steps_v is not None else ([1] * len(axes) if axes is not None else None)
    if axes is not None and steps is not None and all(s == 1 for s in steps):
        idx = ctx.ints(axes)
        dims = ctx.op("Gather", ctx.shape(x), idx)
        rank, static = ctx.rank(x), ctx.dims(x)
        in_range = starts is not None and all(
            s == 0 or (s > 0 and static[a % rank] is not None and s <= static[a % rank])
            for s, a in zip(starts, axes, strict=True)
        )
        if in_range:
            begin = ctx.ints(starts)
        else:
            wrapped = _nonneg_int64(ctx, starts_v, dims)
            begin = ctx.op("Max", ctx.op("Min", wrapped, dims), ctx.const(np.int64(0)))
        grown = ctx.op("Sub", dims, ctx.op("Gather", ctx.shape(dy), idx))
        pads = ctx.op("Concat", begin, ctx.op("Sub", grown, begin), axis=0)
        return (ctx.op("Pad", dy, full_pads(ctx, pads, [a % rank for a in axes], rank)),) + none
    positions = ctx.op("Slice", _flat_positions(ctx, x), *node.inputs[1:])
    return (_scatter_back(ctx, x, positions, dy),) + none


def full_pads(ctx: Ctx, pads: V, axes: list[int], rank: int) -> V:
    """Pad's ``pads`` for every axis of a rank-``rank`` tensor, from ``pads`` for ``axes``
    (their begins, then their ends), so the Pad needs no ``axes`` input.

    ONNX Runtime's transpose optimizer (1.32, at every optimization level) moves Transposes
    through a Pad as if its pads covered every axis: with an ``axes`` input it permutes the
    shorter pads with a Gather that fails (timm-style Swin: ``Gather node 'Gather_token_146':
    indices element out of data bounds, idx=2 must be within [-2,1]``; reproducer in
    ``tests/test_dynamo_vision.py``).
    """
    if axes == list(range(rank)):
        return pads
    where = ctx.ints([*axes, *(a + rank for a in axes)])
    return ctx.op("ScatterElements", ctx.ints([0] * (2 * rank)), where, pads, axis=0)


def _nonneg_int64(ctx: Ctx, indices: V, dims: V) -> V:
    """``indices`` as int64 with negative values counted from the back (``+ dims``, which
    broadcasts against them): ScatterND takes int64 only, and not every kernel wraps."""
    idx = indices if indices.dtype == ir.DataType.INT64 else ctx.op("Cast", indices, to=ir.DataType.INT64)
    negative = ctx.op("Less", idx, ctx.const(np.int64(0)))
    return ctx.op("Where", negative, ctx.op("Add", idx, dims), idx)


def _dim(ctx: Ctx, x: V, axis: int) -> V:
    """Runtime size of ``x`` along ``axis`` as an int64 scalar (rank 0: it must not
    broadcast a rank-0 index up to rank 1)."""
    return ctx.op("Gather", ctx.shape(x), ctx.const(np.int64(axis)))


@register("Gather", opsets=(13, None))
def gather(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Scatter-add ``dy`` back along ``axis`` (repeated indices accumulate), for indices of any
    rank (0 included), any axis and negative index values.

    Axis 0 (embeddings): ScatterND of whole rows. Other axes: ``dy`` with its index dims
    flattened into one (``data.shape`` with ``axis`` replaced by the index count) and
    ScatterElements along ``axis`` with the indices broadcast over the other dims.
    """
    data, indices = ctx.input(0), ctx.input(1)
    rank = ctx.rank(data)
    axis = ctx.attr("axis", 0) % rank
    index = _nonneg_int64(ctx, indices, _dim(ctx, data, axis))
    zeros = ctx.zeros_like(data)
    if axis == 0:
        return ctx.op("ScatterND", zeros, ctx.op("Unsqueeze", index, ctx.ints([-1])), dy, reduction="add"), None
    shape = ctx.op("Concat", ctx.shape(data, 0, axis), ctx.ints([-1]), ctx.shape(data, axis + 1), axis=0)
    updates = ctx.op("Reshape", dy, shape)
    column = ctx.op("Reshape", index, ctx.ints([1] * axis + [-1] + [1] * (rank - axis - 1)))
    where = ctx.op("Expand", column, ctx.shape(updates))
    return ctx.op("ScatterElements", zeros, where, updates, axis=axis, reduction="add"), None


@register("GatherElements", opsets=(13, None))
def gather_elements(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """ScatterElements with reduction add: repeated indices accumulate."""
    data, indices = ctx.input(0), ctx.input(1)
    axis = ctx.attr("axis", 0) % ctx.rank(data)
    index = _nonneg_int64(ctx, indices, _dim(ctx, data, axis))
    return ctx.op("ScatterElements", ctx.zeros_like(data), index, dy, axis=axis, reduction="add"), None


@register("GatherND", opsets=(13, None))
def gather_nd(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """ScatterND with reduction add. ``batch_dims`` b > 0: the batch dims are flattened into
    one, P, and each index tuple gets its batch position prepended, so a plain ScatterND
    into ``[P, *data.shape[b:]]`` does it."""
    data, indices = ctx.input(0), ctx.input(1)
    b = ctx.attr("batch_dims", 0)
    r, q = ctx.rank(data), ctx.rank(indices)
    k = ctx.dims(indices)[-1]
    if k is None:  # the tuple length from the ranks: rank(y) = q + r - k - 1 - b
        k = q + r - 1 - b - ctx.rank(node.outputs[0])
    index = _nonneg_int64(ctx, indices, ctx.shape(data, b, b + k))
    if b == 0:
        return ctx.op("ScatterND", ctx.zeros_like(data), index, dy, reduction="add"), None
    tuples = ctx.op("Reshape", ctx.op("Flatten", index, axis=b), ctx.ints([0, -1, k]))  # [P, M, k]
    pm = ctx.shape(tuples, 0, 2)
    count = ctx.op("Squeeze", ctx.shape(tuples, 0, 1), ctx.ints([0]))
    batch = ctx.op("Range", ctx.const(np.int64(0)), count, ctx.const(np.int64(1)))
    batch = ctx.op("Reshape", batch, ctx.ints([-1, 1, 1]))
    batch = ctx.op("Expand", batch, ctx.op("Concat", pm, ctx.ints([1]), axis=0))
    full = ctx.op("Concat", batch, tuples, axis=2)  # [P, M, 1 + k]
    updates = ctx.op("Reshape", dy, ctx.op("Concat", pm, ctx.shape(data, b + k), axis=0))
    zeros = ctx.op("ConstantOfShape", ctx.op("Concat", ctx.shape(tuples, 0, 1), ctx.shape(data, b), axis=0),
                   value=ir.tensor(np.zeros((1,), dtype=ctx.np_dtype(data))))
    scattered = ctx.op("ScatterND", zeros, full, updates, reduction="add")
    return ctx.op("Reshape", scattered, ctx.shape(data)), None


@register("Tile", opsets=(13, None))
def tile(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """``dy`` viewed as ``[r0, d0, r1, d1, ...]`` summed over the repeat axes (runtime repeats too)."""
    x, repeats = ctx.input(0), ctx.input(1)
    rank = ctx.rank(x)
    column = ctx.ints([1])
    pairs = ctx.op("Concat", ctx.op("Unsqueeze", repeats, column), ctx.op("Unsqueeze", ctx.shape(x), column), axis=1)
    split = ctx.op("Reshape", dy, ctx.op("Reshape", pairs, ctx.ints([-1])))
    return ctx.op("ReduceSum", split, ctx.ints(range(0, 2 * rank, 2)), keepdims=0), None


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
    """constant: slice the interior (Pad by the negated pads where pads are runtime or
    negative); reflect/edge/wrap: pad the element positions the same way and scatter-add the
    gradient back through them."""
    x, pads_v = ctx.input(0), ctx.input(1)
    mode, pads = ctx.attr("mode", "constant"), ctx.const_ints(pads_v)
    none = (None,) * (len(node.inputs) - 1)
    axes_v = ctx.optional_input(3)
    known = ctx.const_ints(axes_v)

    def pad_by(data: V, pads_for_axes: V, **attrs: str) -> V:
        if axes_v is not None and known is None:  # runtime axes: as given
            return ctx.op("Pad", data, pads_for_axes, None, axes_v, **attrs)
        if known is not None:
            rank = ctx.rank(x)
            pads_for_axes = full_pads(ctx, pads_for_axes, [a % rank for a in known], rank)
        return ctx.op("Pad", data, pads_for_axes, **attrs)

    if mode != "constant":
        positions = pad_by(_flat_positions(ctx, x), pads_v, mode=mode)
        return (_scatter_back(ctx, x, positions, dy),) + none
    if pads is None or any(p < 0 for p in pads):
        # Runtime or negative (cropping) pads: the adjoint is the Pad by the negated pads,
        # which crops what was added and zero-fills what was cropped.
        return (pad_by(dy, ctx.op("Neg", pads_v)),) + none
    axes = ctx.required_ints(axes_v, "Pad axes") if axes_v is not None else list(range(ctx.rank(x)))
    begin = ctx.ints(pads[: len(axes)])
    end = ctx.op("Add", begin, ctx.op("Gather", ctx.shape(x), ctx.ints(axes)))
    return (ctx.op("Slice", dy, begin, end, ctx.ints(axes)),) + none
