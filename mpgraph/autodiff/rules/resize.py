"""Gradient rule for Resize, and the separable-adjoint helper AveragePool's ceil_mode rule shares.

Every Resize mode (nearest, linear, cubic, antialiased) resamples each axis on its own:
``Y = X x_1 A_1 x_2 A_2 ...``, where ``A_d`` is the ``[out_d, in_d]`` interpolation matrix of
axis ``d`` (one 1 per row for nearest). The gradient is the adjoint, ``dX = dY x_1 A_1^T ...``:
one MatMul per resized axis, and for nearest that MatMul is the scatter-add of ``dY`` onto the
pixels each output copied.

``A_d`` is not rebuilt from the coordinate formulas. It is the same Resize node (same mode,
coordinate_transformation_mode, nearest_mode, cubic coefficient, scale or size) applied to an
identity laid along axis ``d``: ``E[i, ..., j, ...] = [i == j]``, the basis index ``i`` on an
axis that is not resized. So the gradient follows the runtime's own coordinate transform,
rounding and clamping for every mode, with scales or sizes, and with dynamic sizes (the
identity is built from the input's runtime shape). Where the matrix's inputs are constants,
ONNX Runtime folds it when the session starts.

Worked example: ``F.interpolate(x, scale_factor=2, mode="bilinear")`` on a ``[N, C, 5, 7]``
input exports ``Resize(mode=linear, half_pixel, scales=[1, 1, 2, 2])``. The rule resizes a
``[5, 1, 5, 1]`` identity with scales ``[1, 1, 2, 1]`` into ``A_H^T`` (``[5, 10]``) and a
``[7, 1, 1, 7]`` one with ``[1, 1, 1, 2]`` into ``A_W^T`` (``[7, 14]``), then
``dX = A_H^T @ (dY @ A_W)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register
from mpgraph.errors import GradientError

__all__ = ["axis_identity", "separable_adjoint"]

V = ir.Value
Ctx = GradContext


def axis_identity(ctx: Ctx, x: V, axis: int, basis: int) -> V:
    """An identity of ``x``'s size ``n`` along ``axis`` with the same rank as ``x``: shape
    ``n`` on ``axis`` and on ``basis``, 1 elsewhere, ``E[.., i (basis), .., j (axis), ..] = [i == j]``."""
    rank = ctx.rank(x)
    n = ctx.dims(x)[axis]
    if n is not None:
        shape = [1] * rank
        shape[axis] = shape[basis] = n
        return ctx.const(np.eye(n).reshape(shape), x.dtype)
    size = ctx.shape(x, axis, axis + 1)
    square = ctx.op("ConstantOfShape", ctx.op("Concat", size, size, axis=0),
                    value=ir.tensor(np.zeros((1,), dtype=ctx.np_dtype(x))))
    parts = [size if i in (axis, basis) else ctx.ints([1]) for i in range(rank)]
    return ctx.op("Reshape", ctx.op("EyeLike", square), ctx.op("Concat", *parts, axis=0))


def separable_adjoint(ctx: Ctx, dy: V, x: V, axes: list[int], apply: Callable[[int, int, V], V]) -> V:
    """``dX = dY x_d A_d^T`` over ``axes`` for a separable linear map ``X -> Y`` (rank >= 2).

    ``apply(axis, basis, E)`` must return the forward map applied to ``E = axis_identity(x,
    axis, basis)`` along ``axis`` only: ``A_axis^T`` laid out on the ``basis`` and ``axis``
    dims of a tensor whose other dims are 1. The MatMuls cost ``in * out`` multiply-adds per
    row of each axis where the forward reads a few taps per output (a bilinear 4x upsample of
    a 128x128 map: 512*512*128 + 128*512*128 = 42M per channel against 4*512*512 = 1M), but
    they run as GEMMs.
    """
    rank = ctx.rank(x)
    if rank < 2:
        raise GradientError(f"node '{ctx.node.name if ctx.node else '?'}': a rank-{rank} input has no gradient rule here (rank >= 2)")
    grad = dy
    for axis in sorted(axes, reverse=True):
        basis = 0 if axis != 0 else 1
        laid_out = apply(axis, basis, axis_identity(ctx, x, axis, basis))
        others = [i for i in range(rank) if i not in (axis, basis)]
        matrix = ctx.op("Squeeze", laid_out, ctx.ints(others)) if others else laid_out
        # ``matrix`` is A^T ([in, out]) when the basis dim comes first, else A ([out, in]).
        if axis == rank - 2:  # A^T @ dY over the last two dims
            a_t = matrix if basis < axis else ctx.op("Transpose", matrix, perm=[1, 0])
            grad = ctx.op("MatMul", a_t, grad)
            continue
        a = matrix if basis > axis else ctx.op("Transpose", matrix, perm=[1, 0])
        if axis == rank - 1:
            grad = ctx.op("MatMul", grad, a)
            continue
        perm = [i for i in range(rank) if i != axis] + [axis]
        moved = ctx.op("MatMul", ctx.op("Transpose", grad, perm=perm), a)
        grad = ctx.op("Transpose", moved, perm=[perm.index(i) for i in range(rank)])
    return grad


def _present(value: V | None) -> V | None:
    return value if value is not None and value.name != "" else None


def _const_int(value: V | None) -> int | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else int(tensor.numpy().reshape(-1)[0])


def _copied_input_dims(sizes: V, x: V) -> list[int | None]:
    """For each element of a runtime ``sizes``, the axis of ``x`` whose runtime size it copies
    (``None`` where unknown; ``[]`` when the layout is not understood). The TorchScript exporter
    writes ``size=(h, w)`` as ``Concat(Slice(Shape(x), 0, 2), [h, w])``: batch and channels
    are kept, and need no MatMul."""
    producer = sizes.producer()
    parts = list(producer.inputs) if producer is not None and producer.op_type == "Concat" else [sizes]
    found: list[int | None] = []
    for part in parts:
        node = part.producer() if part is not None else None
        begin, stop = 0, None
        if node is not None and node.op_type == "Slice" and (len(node.inputs) == 3 or (
                len(node.inputs) == 4 and _const_int(node.inputs[3]) in (0, -1))):
            begin, stop = _const_int(node.inputs[1]), _const_int(node.inputs[2])
            node = node.inputs[0].producer() if begin is not None and stop is not None and node.inputs[0] is not None else None
        if node is not None and node.op_type == "Shape" and node.inputs[0] is x and x.shape is not None:
            first, last = (node.attributes[k].value if k in node.attributes else d for k, d in (("start", 0), ("end", None)))
            found.extend(list(range(len(x.shape)))[first:last][begin:stop])
        elif part is not None and part.shape is not None and len(part.shape) == 1 and isinstance(part.shape[0], int):
            found.extend([None] * part.shape[0])
        else:
            return []
    return found


def _resized_axes(ctx: Ctx, x: V, y: V, scales: V | None, sizes: V | None, axes: list[int], crop: bool) -> list[int]:
    """The axes the node may resample: every one unless a constant scale of 1 (or a constant or
    static size equal to the input's) proves it the identity, which tf_crop_and_resize never is."""
    if crop:
        return axes
    xs, ys = ctx.dims(x), ctx.dims(y)
    if scales is not None and (values := ir.convenience.get_const_tensor(scales)) is not None:
        return [a for a, s in zip(axes, values.numpy().reshape(-1).tolist(), strict=True) if s != 1.0]
    if sizes is not None and (wanted := ctx.const_ints(sizes)) is not None:
        return [a for a, m in zip(axes, wanted, strict=True) if xs[a] is None or m != xs[a]]
    copied = _copied_input_dims(sizes, x) if sizes is not None else []
    copied = copied if len(copied) == len(axes) else [None] * len(axes)
    return [a for a, c in zip(axes, copied, strict=True)
            if c != a and (xs[a] is None or ys[a] is None or xs[a] != ys[a] or scales is not None)]


@register("Resize", opsets=(11, None))
def resize(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """dX is dY resampled by the transposed interpolation matrix of each resized axis."""
    x, y = ctx.input(0), node.outputs[0]
    roi, scales, sizes = (_present(ctx.optional_input(i)) for i in (1, 2, 3))
    mode = ctx.attr("coordinate_transformation_mode", "half_pixel")
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch" or mode == "tf_half_pixel_for_nn":
        raise GradientError(f"Resize node '{node.name}': keep_aspect_ratio_policy={policy} and "
                            f"coordinate_transformation_mode={mode} have no gradient rule (stretch only)")
    rank = ctx.rank(x)
    axes = [a % rank for a in ctx.attr("axes") or range(rank)]
    crop = mode == "tf_crop_and_resize"
    roi_values = None
    if crop:
        if roi is None or (tensor := ir.convenience.get_const_tensor(roi)) is None:
            raise GradientError(f"Resize node '{node.name}': tf_crop_and_resize needs a constant roi for its gradient")
        roi_values = tensor.numpy().reshape(-1).astype(np.float64)
    attrs = {k: ctx.attr(k) for k in ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                                      "exclude_outside", "antialias")}

    def apply(axis: int, basis: int, eye: V) -> V:
        k = axes.index(axis)
        roi_e = None
        if roi_values is not None:  # this axis's crop, the whole extent elsewhere
            starts, ends = np.zeros(rank), np.ones(rank)
            starts[axis], ends[axis] = roi_values[k], roi_values[len(axes) + k]
            roi_e = ctx.const(np.concatenate([starts, ends]), roi.dtype if roi is not None else None)
        if sizes is None:
            scale = ctx.op("Slice", scales, ctx.ints([k]), ctx.ints([k + 1]))
            parts = [scale if i == axis else ctx.const(np.ones(1, np.float32)) for i in range(rank)]
            return ctx.op("Resize", eye, roi_e, ctx.op("Concat", *parts, axis=0), extrapolation_value=0.0, **attrs)
        wanted, n = ctx.const_ints(sizes), ctx.dims(x)[axis]
        out = ctx.ints([wanted[k]]) if wanted is not None else ctx.op("Slice", sizes, ctx.ints([k]), ctx.ints([k + 1]))
        size = ctx.ints([n]) if n is not None else ctx.shape(x, axis, axis + 1)
        parts = [out if i == axis else size if i == basis else ctx.ints([1]) for i in range(rank)]
        return ctx.op("Resize", eye, roi_e, None, ctx.op("Concat", *parts, axis=0), extrapolation_value=0.0, **attrs)

    if scales is None and sizes is None:
        raise GradientError(f"Resize node '{node.name}': needs scales or sizes")
    dx = separable_adjoint(ctx, dy, x, _resized_axes(ctx, x, y, scales, sizes, axes, crop), apply)
    return dx, None, None, None
