"""Gradient rules for Conv and pooling.

Data gradients are ``ConvTranspose`` (the adjoint of a strided convolution, and vice versa for
ConvTranspose); the weight gradient is a convolution of the input with the output gradient,
batch and channels swapped (stride and dilation swap roles), emitted either as that one Conv or
as an im2col (a Conv with a one-hot kernel) and a GEMM, whichever measures faster for the layer
shape; MaxPool routes gradients through its indices output.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register
from mpgraph.autodiff.rules.resize import separable_adjoint
from mpgraph.errors import GradientError

__all__: list[str] = []

V = ir.Value
Ctx = GradContext

#: Emit unit-stride data gradients as a Conv with the flipped kernel (else ConvTranspose).
UNIT_STRIDE_AS_CONV = True

#: A weight-gradient form forced for every layer, for tests and benchmarks that cover each
#: form: ``"conv"`` the single-Conv form, ``"slices"`` the per-tap Slice + MatMul form (one
#: group, static dims), ``"im2col"`` the one-hot im2col forms (SpaceToDepth where it
#: applies). ``None`` (always, outside tests): the form comes from the differentiation's
#: ``target`` (``TARGET_FORM``), else from the layer shape (``_weight_grad_form``).
WEIGHT_GRAD_FORM: str | None = None

#: The weight-gradient form per ``target`` of the differentiation (``GradContext.target``);
#: a target not listed (``None``, ``cpu``) picks each layer's form by shape, from ORT CPU
#: measurements. On ORT CUDA (H200) the one-hot im2col form beat the single Conv on the
#: Nature DQN's 8x8/4 (0.085 vs 0.309 ms) and 4x4/2 layers (0.074 vs 0.117 ms).
TARGET_FORM: dict[str, str] = {"cuda": "im2col"}


def _geometry(ctx: Ctx, node: ir.Node, kernel: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Strides, explicit pads (begin..., end...) and dilations of a conv/pool node."""
    x = ctx.input(0)
    n = ctx.rank(x) - 2
    strides = ctx.attr("strides") or [1] * n
    dilations = ctx.attr("dilations") or [1] * n
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", "VALID"):
        pads = ctx.attr("pads") or [0] * (2 * n) if auto_pad == "NOTSET" else [0] * (2 * n)
        return strides, pads, dilations
    sizes = ctx.dims(x)[2:]
    if any(s is None for s in sizes):
        raise GradientError(f"node '{node.name}': auto_pad={auto_pad} needs static spatial dims")
    begin, end = [], []
    for size, s, k, d in zip(sizes, strides, kernel, dilations, strict=True):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small = total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return strides, begin + end, dilations


def _data_grad(ctx: Ctx, node: ir.Node, dy: V, w: V, kernel: list[int], group: int) -> V:
    """The adjoint of the convolution of ``node`` applied to ``dy``: a Conv with the flipped
    kernel for unit strides, else ConvTranspose sized back to the input (output_padding or Pad)."""
    x, y = ctx.input(0), node.outputs[0]
    strides, pads, dilations = _geometry(ctx, node, kernel)
    n = len(strides)
    xs, ys = ctx.dims(x)[2:], ctx.dims(y)[2:]
    attrs = dict(strides=strides, pads=pads, dilations=dilations, group=group)
    m, cg = ctx.dims(w)[0], ctx.dims(w)[1]
    full = [(kernel[i % n] - 1) * dilations[i % n] - pads[i] for i in range(2 * n)]
    # Where the input has more positions than the output (a one-group conv padded less than
    # "same"), the flipped Conv also computes the zero border: ConvTranspose is faster there
    # (conv_dw_ab.txt, 1 thread, CPU time: the DQN's 3x3/1 layer 1.97 vs 3.06 ms, unpadded
    # 4x4/1 and 5x5/1 layers 0.47-0.63x; the ResNet's "same" 3x3 layers keep the Conv).
    border = group == 1 and None not in xs + ys and len(xs) == len(ys) == n and math.prod(xs) > math.prod(ys)  # type: ignore[arg-type]
    if (UNIT_STRIDE_AS_CONV and all(s == 1 for s in strides) and m is not None and cg is not None and min(full) >= 0
            and not border):
        # Unit stride: a plain Conv with the kernel flipped and in/out channels swapped per
        # group (ORT's Conv is much faster than its ConvTranspose).
        spatial = list(range(3, n + 3))
        swapped = ctx.op("Transpose", ctx.op("Reshape", w, ctx.ints([group, m // group, cg, *kernel])), perm=[0, 2, 1, *spatial])
        flipped = ctx.op("Slice", ctx.op("Reshape", swapped, ctx.ints([group * cg, m // group, *kernel])),
                         ctx.ints([-1] * n), ctx.ints([-(2**62)] * n), ctx.ints(range(2, n + 2)), ctx.ints([-1] * n))
        return ctx.op("Conv", dy, flipped, pads=full, dilations=dilations, group=group)
    xi, yi = [v for v in xs if v is not None], [v for v in ys if v is not None]
    if len(xi) == len(yi) == n:
        extra = [xi[i] - ((yi[i] - 1) * strides[i] - pads[i] - pads[n + i] + dilations[i] * (kernel[i] - 1) + 1) for i in range(n)]
        if all(0 <= e < max(strides[i], dilations[i]) for i, e in enumerate(extra)):
            return ctx.op("ConvTranspose", dy, w, output_padding=extra if any(extra) else None, **attrs)
    # Runtime sizes: the ConvTranspose crops only the leading pads, and a Pad sizes the rest
    # to the input's: it adds the zero rows past the last window, or crops the trailing pads
    # (a negative pad). Cropping the trailing pads in the ConvTranspose too cut rows that
    # windows read: a 3x3/2 conv padded 1 on 8 rows, whose last window reads row 7, lost
    # row 7's gradient (ConvTranspose gives 7 rows; 41% off for a per-channel scale before).
    dx = ctx.op("ConvTranspose", dy, w, **dict(attrs, pads=pads[:n] + [0] * n))
    missing = ctx.op("Sub", ctx.shape(x, 2), ctx.shape(dx, 2))
    # Pads for every axis, no ``axes`` input: ONNX Runtime's transpose optimizer mishandles
    # one (``shape.full_pads``).
    pads_v = ctx.op("Concat", ctx.ints([0] * (n + 4)), missing, axis=0)
    return ctx.op("Pad", dx, pads_v)


def _large_map(ctx: Ctx, like_dy: V, kernel: list[int], rows: int) -> bool:
    """More output positions per sample than twice the output channels per group (or unknown)."""
    positions = [p for p in ctx.dims(like_dy)[2:] if p is not None]
    return not (len(positions) == len(kernel) and math.prod(positions) <= 2 * rows)


def _weight_grad(
    ctx: Ctx, x: V, dy: V, like_dy: V, m: int, cg: int, geometry: tuple, kernel: list[int], group: int
) -> V:
    """dW[m, c, k] = sum_{n, o} x[n, c, o*s + k*d - p] dy[n, m, o] of the convolution x -> dy,
    whose weight is ``[m, cg, *kernel]`` (out, in per group).

    im2col as a Conv with a one-hot kernel (``cols[n, c*K + j, o] = x[n, c, o*s + j*d - p]``),
    then GEMM-shaped work that ORT runs fast (a convolution with dy as its kernel is not). Two
    layouts, picked by the output positions per sample (``P``) against the output channels
    per group (``M``):

    - ``P > 2M`` (early, large feature maps): one MatMul per sample, ``cols[n] @ dy[n]^T``
      (``[C*K, P] x [P, M]``: ORT packs the small dy operand), then a sum over the batch, whose
      ``N*M*C*K`` partial products are small next to cols;
    - ``P <= 2M`` (late, small maps, where those partial products would be as large as cols):
      batch moved inside by two block Transposes, then one GEMM over ``N*P``.

    On the zoo's ResNet and DQN shapes at 2 threads this halves the weight-gradient time of the
    small-map convolutions against the per-sample form.
    """
    strides, pads, dilations = geometry
    taps = int(np.prod(kernel))
    channels = cg * group
    if taps == 1 and not any(pads) and all(s == 1 for s in strides):
        cols = x
    else:
        one_hot = np.zeros([channels * taps, 1, *kernel])
        for c in range(channels):
            for j in range(taps):
                one_hot[(c * taps + j, 0, *(int(t) for t in np.unravel_index(j, kernel)))] = 1.0
        cols = ctx.op("Conv", x, ctx.const(one_hot, x.dtype if x.dtype is not None else None), strides=strides,
                      pads=pads, dilations=dilations, group=channels)
    rows, depth = m // group, cg * taps
    dy_g = ctx.op("Reshape", dy, ctx.ints([0, group, rows, -1]))
    cols_g = ctx.op("Reshape", cols, ctx.ints([0, group, depth, -1]))
    if not _large_map(ctx, like_dy, kernel, rows):
        dy_t = ctx.op("Reshape", ctx.op("Transpose", dy_g, perm=[1, 2, 0, 3]), ctx.ints([group, rows, -1]))
        cols_t = ctx.op("Reshape", ctx.op("Transpose", cols_g, perm=[1, 2, 0, 3]), ctx.ints([group, depth, -1]))
        if group == 1:
            grad = ctx.op("Gemm", ctx.op("Reshape", dy_t, ctx.ints([rows, -1])),
                          ctx.op("Reshape", cols_t, ctx.ints([depth, -1])), transB=1)
        else:
            grad = ctx.op("MatMul", dy_t, ctx.op("Transpose", cols_t, perm=[0, 2, 1]))
    else:
        per_sample = ctx.op("MatMul", cols_g, ctx.op("Transpose", dy_g, perm=[0, 1, 3, 2]))
        # The sum over the batch as ones[1, N] @ per_sample[N, -1]: ORT's ReduceSum over a
        # leading axis of few rows is 8x slower on 2 threads than on 1 ([32, 9216]: 305 vs 40 us).
        batch = ctx.op("Concat", ctx.ints([1]), ctx.shape(dy, 0, 1), axis=0)
        ones = ctx.op("ConstantOfShape", batch, value=ir.tensor(np.ones((1,), dtype=ctx.np_dtype(like_dy))))
        summed = ctx.op("MatMul", ones, ctx.op("Reshape", per_sample, ctx.ints([0, -1])))
        grad = ctx.op("Transpose", ctx.op("Reshape", summed, ctx.ints([group, depth, rows])), perm=[0, 2, 1])
    return ctx.op("Reshape", grad, ctx.ints([m, cg, *kernel]))


def _space_to_depth_weight_grad(
    ctx: Ctx, x: V, dy: V, y: V, m: int, c: int, geometry: tuple, kernel: list[int]
) -> V | None:
    """The weight gradient of a 2-D, ungrouped, unpadded convolution whose stride ``s`` divides
    its kernel, through ``SpaceToDepth``: ``x`` becomes ``[N, s*s*C, H/s, W/s]`` and the
    convolution a unit-stride one with a ``k/s`` kernel, whose im2col is ``s*s`` times cheaper
    to build (the one-hot im2col Conv multiplies by an identity of ``taps`` rows). The Nature
    DQN's 8x8/4 first layer: 4.6 -> 3.4 ms per weight gradient at 2 threads. ``None`` where it
    does not apply (then the direct form is used).
    """
    strides, pads, dilations = geometry
    dims = ctx.dims(x)
    s = strides[0]
    if (len(kernel) != 2 or s < 2 or any(t != s for t in strides) or any(d != 1 for d in dilations) or any(pads)
            or any(k % s for k in kernel) or None in dims[2:] or not _large_map(ctx, y, kernel, m)):
        return None
    usable = [d - d % s for d in dims[2:]]  # rows/cols past the last whole block are never read
    if usable != dims[2:]:
        x = ctx.op("Slice", x, ctx.ints([0, 0]), ctx.ints(usable), ctx.ints([2, 3]))
    packed = ctx.op("SpaceToDepth", x, blocksize=s)  # channel (bh*s + bw)*C + c
    reduced = [k // s for k in kernel]
    grad = _weight_grad(ctx, packed, dy, y, m, s * s * c, ([1, 1], [0] * 4, [1, 1]), reduced, 1)
    blocks = ctx.op("Reshape", grad, ctx.ints([m, s, s, c, *reduced]))  # [m, bh, bw, c, qh, qw]
    return ctx.op("Reshape", ctx.op("Transpose", blocks, perm=[0, 3, 4, 1, 5, 2]), ctx.ints([m, c, *kernel]))


def _conv_weight_grad(
    ctx: Ctx, x: V, dy: V, like_dy: V, m: int, cg: int, geometry: tuple, kernel: list[int], group: int
) -> V:
    """The weight gradient as one Conv, with no im2col tensor: ``x`` with batch and channels
    swapped (``[cg, group*N, *in]``) convolved with ``dy``, also swapped (``[m, N, *out]``), as
    its kernel, ``group`` groups; the forward stride becomes the dilation and the forward
    dilation the stride. The result ``[cg, m, *k']`` is cut to the kernel (``k' > k`` where the
    input has rows no tap reads) and transposed to ``[m, cg, *kernel]``.
    """
    strides, pads, dilations = geometry
    n = len(kernel)
    spatial = list(range(2, n + 2))
    sizes, out = ctx.dims(x)[2:] or [None] * n, ctx.dims(like_dy)[2:] or [None] * n  # gradients may lack shapes
    begin, end = list(pads[:n]), list(pads[n:])
    if None not in sizes and None not in out:
        # End pads only as far as the last tap reads (the ResNet's 3x3/2 convs need none).
        end = [max(0, (k - 1) * d + (o - 1) * s + 1 - size - b)
               for k, d, o, s, size, b in zip(kernel, dilations, out, strides, sizes, begin, strict=True)]
    if group == 1:
        xt = ctx.op("Transpose", x, perm=[1, 0, *spatial])
    else:  # [N, group*cg, *in] -> [cg, group*N, *in]: each group's samples form its input channels
        blocks = ctx.op("Transpose", ctx.op("Reshape", x, ctx.ints([0, group, cg, -1])), perm=[2, 1, 0, 3])
        xt = ctx.op("Reshape", blocks, ctx.op("Concat", ctx.ints([cg, -1]), ctx.shape(x, 2), axis=0))
    dyt = ctx.op("Transpose", dy, perm=[1, 0, *spatial])
    grad = ctx.op("Conv", xt, dyt, strides=dilations, dilations=strides, pads=begin + end, group=group)
    reach = [(size + b + e - (o - 1) * s - 1) // d + 1 if size is not None and o is not None else None
             for size, b, e, o, s, d in zip(sizes, begin, end, out, strides, dilations, strict=True)]
    if reach != kernel:
        grad = ctx.op("Slice", grad, ctx.ints([0] * n), ctx.ints(kernel), ctx.ints(spatial))
    return ctx.op("Transpose", grad, perm=[1, 0, *spatial])


def _slices_weight_grad(
    ctx: Ctx, x: V, dy: V, like_dy: V, m: int, c: int, geometry: tuple, kernel: list[int]
) -> V | None:
    """The weight gradient of a one-group convolution as one Slice of the input per kernel tap
    (``x`` with batch and channels swapped, padded: ``[C, N, *out]``) and one MatMul per tap,
    ``[C, N*P] x [N*P, M]``: im2col by copies, with no one-hot Conv and no transposed cols.
    ``None`` where the spatial dims are not static.
    """
    strides, pads, dilations = geometry
    n = len(kernel)
    sizes, out = ctx.dims(x)[2:] or [None] * n, ctx.dims(like_dy)[2:] or [None] * n
    if None in out or None in sizes:
        return None
    spatial = list(range(2, n + 2))
    begin = list(pads[:n])
    end = [max(0, (k - 1) * d + (o - 1) * s + 1 - size - b)
           for k, d, o, s, size, b in zip(kernel, dilations, out, strides, sizes, begin, strict=True)]
    xt = ctx.op("Transpose", x, perm=[1, 0, *spatial])
    if any(begin) or any(end):
        xt = ctx.op("Pad", xt, ctx.ints([0, 0, *begin, 0, 0, *end]))
    taps = []
    for index in np.ndindex(*kernel):
        starts = [t * d for t, d in zip(index, dilations, strict=True)]
        ends = [b + (o - 1) * s + 1 for b, o, s in zip(starts, out, strides, strict=True)]
        taps.append(ctx.op("Slice", xt, ctx.ints(starts), ctx.ints(ends), ctx.ints(spatial), ctx.ints(strides)))
    dy_rows = ctx.op("Reshape", ctx.op("Transpose", dy, perm=[0, *spatial, 1]), ctx.ints([-1, m]))
    # One MatMul per tap, not one over the concatenated taps: no copy of the whole im2col
    # (ResNet 3x3 32x32 layer at 1 thread: 4.2 vs 5.9 ms; the DQN's 3x3 layer: equal).
    parts = [ctx.op("MatMul", ctx.op("Reshape", t, ctx.ints([c, -1])), dy_rows) for t in taps]
    grad = ctx.op("Reshape", ctx.op("Concat", *parts, axis=0), ctx.ints([len(taps), c, m]))
    grad = ctx.op("Transpose", grad, perm=[2, 1, 0])  # [M, C, taps]
    return ctx.op("Reshape", grad, ctx.ints([m, c, *kernel]))


def _weight_grad_form(target: str | None, kernel: list[int], geometry: tuple, c: int, group: int,
                      small_map: bool) -> str:
    """The form forced (``WEIGHT_GRAD_FORM``), else ``target``'s (``TARGET_FORM``), else the
    weight-gradient form that measures faster on ORT CPU for this layer shape.

    ``benchmarks/results/conv_dw_ab.txt`` (from the one-off probe ``benchmarks/conv_dw_ab.py`` at
    be82dfc), ms of the form over ms of the one-hot im2col forms (SpaceToDepth where it
    applies); 1 thread in CPU time, 2 threads in wall time on a loaded machine:

    - ``slices`` (one group, unit stride, no pads, 2 to 16 taps, 16 input channels or more,
      small maps ``P <= 2M``): the DQN's 3x3/1 layer 0.73-0.77 (2 threads 0.85). Its copies
      run on one thread while the one-hot Conv uses both: on the ResNet's 32x32 and 16x16 3x3/1
      maps 0.77-0.80 at 1 thread but 2.0-2.6 at 2; on its padded 8x8 map 0.79-0.86 at 1 thread,
      yet the ResNet step with it measured 1.03-1.04 at 2 threads, so the ResNet keeps im2col.
      Strided layers lose (strided Slice copies are slow: 3x3/2 1.13-1.4, 8x8/4 1.6-3.6).
    - ``conv`` (one group, other layers of 16 taps or more): 8x8/4 0.68 (2 threads 0.82), 4x4/2
      0.68 (0.86), 7x7/2 0.66, 5x5/2 0.84, 4x4/1 0.69-0.78, 5x5/1 1.03-1.06. ORT runs it as, per
      input channel, a GEMM ``[M, N*P] x [N*P, taps]`` whose few columns waste MLAS's 16-wide
      kernel at small taps: 3x3 1.2-2.1, 1x1/2 13x.
    - ``im2col`` otherwise (grouped convs: depthwise 3x3 single-Conv 1.13 and 0.78).
    """
    if WEIGHT_GRAD_FORM is not None:
        return WEIGHT_GRAD_FORM
    if target in TARGET_FORM:
        return TARGET_FORM[target]
    strides, pads, _ = geometry
    taps = math.prod(kernel)
    if group == 1 and 1 < taps <= 16 and all(s == 1 for s in strides) and not any(pads) and c >= 16 and small_map:
        return "slices"
    if group == 1 and taps >= 16:
        return "conv"
    return "im2col"


def _pick_weight_grad(
    ctx: Ctx, x: V, dy: V, like_dy: V, m: int, cg: int, geometry: tuple, kernel: list[int], group: int,
    space_to_depth: bool = True,
) -> V:
    """The weight gradient in the form that measures faster for this layer shape (the im2col
    forms where the chosen one does not apply)."""
    form = _weight_grad_form(ctx.target, kernel, geometry, cg * group, group,
                             not _large_map(ctx, like_dy, kernel, m // group))
    if form == "conv":
        return _conv_weight_grad(ctx, x, dy, like_dy, m, cg, geometry, kernel, group)
    dw = None
    if form == "slices" and group == 1:
        dw = _slices_weight_grad(ctx, x, dy, like_dy, m, cg, geometry, kernel)
    if dw is None and group == 1 and space_to_depth:
        dw = _space_to_depth_weight_grad(ctx, x, dy, like_dy, m, cg, geometry, kernel)
    return dw if dw is not None else _weight_grad(ctx, x, dy, like_dy, m, cg, geometry, kernel, group)


@register("Conv", opsets=(11, None))
def conv(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x, w = ctx.input(0), ctx.input(1)
    kernel: list[int] = ctx.attr("kernel_shape") or ctx.static_dims(w, "Conv kernel shape")[2:]
    group = ctx.attr("group", 1)
    dx = _data_grad(ctx, node, dy, w, kernel, group) if ctx.needs(0) else None
    geometry = _geometry(ctx, node, kernel)
    dw = None
    if ctx.needs(1):
        m, cg = ctx.static_dims(w, "weight shape")[:2]
        dw = _pick_weight_grad(ctx, x, dy, node.outputs[0], m, cg, geometry, kernel, group)
    db = None
    if len(node.inputs) > 2 and ctx.needs(2):
        db = ctx.op("ReduceSum", dy, ctx.ints([0, *range(2, ctx.rank(x))]), keepdims=0)
    return dx, dw, db


@register("ConvTranspose", opsets=(11, None))
def conv_transpose(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """The adjoint of Conv: dX is a Conv of dY, dW the Conv weight gradient with x and dy swapped."""
    x, w = ctx.input(0), ctx.input(1)
    kernel: list[int] = ctx.attr("kernel_shape") or ctx.static_dims(w, "ConvTranspose kernel shape")[2:]
    if ctx.attr("auto_pad", "NOTSET") != "NOTSET" or ctx.attr("output_shape"):
        raise GradientError(f"ConvTranspose node '{node.name}': only explicit pads and static kernels are supported")
    group = ctx.attr("group", 1)
    strides, pads, dilations = _geometry(ctx, node, kernel)
    attrs = dict(strides=strides, pads=pads, dilations=dilations, group=group)
    dx = ctx.op("Conv", dy, w, **attrs) if ctx.needs(0) else None
    dw = None
    if ctx.needs(1):
        m, cg = ctx.static_dims(w, "weight shape")[:2]
        dw = _pick_weight_grad(ctx, dy, x, x, m, cg, (strides, pads, dilations), kernel, group, space_to_depth=False)
    db = None
    if len(node.inputs) > 2 and ctx.needs(2):
        db = ctx.op("ReduceSum", dy, ctx.ints([0, *range(2, ctx.rank(x))]), keepdims=0)
    return dx, dw, db


@register("MaxPool", opsets=(12, None), outputs=2)
def max_pool(ctx: Ctx, node: ir.Node, dy: V, *_: V | None) -> tuple:
    x, indices = ctx.input(0), node.outputs[1]
    if ctx.attr("storage_order", 0):
        raise GradientError(f"MaxPool node '{node.name}': storage_order=1 is not supported")
    flat = ctx.ints([-1])
    size = ctx.op("Reshape", ctx.op("Size", x), ctx.ints([1]))
    zeros = ctx.op("ConstantOfShape", size, value=ir.tensor(np.zeros((1,), dtype=ctx.np_dtype(x))))
    scattered = ctx.op("ScatterElements", zeros, ctx.op("Reshape", indices, flat),
                       ctx.op("Reshape", dy, flat), reduction="add")
    return (ctx.op("Reshape", scattered, ctx.shape(x)),)


def _separable_average_pool(ctx: Ctx, node: ir.Node, dy: V, kernel: list[int]) -> V:
    """The adjoint of AveragePool as one MatMul per spatial axis (``separable_adjoint``).

    Average pooling is separable: a window's sum is a sum over each axis in turn, and its
    divisor (the window's extent clipped to the padded input, or to the input when
    ``count_include_pad=0``) is the product of per-axis extents. So ``A_d^T`` is the same pool
    run along axis ``d`` alone over an identity, which follows the runtime's ceil_mode windows
    (the last may overhang the padded input) and divisors exactly.
    """
    x = ctx.input(0)
    strides, pads, dilations = _geometry(ctx, node, kernel)
    n = len(kernel)
    for i, size in enumerate(ctx.dims(x)[2:]):
        span = None if size is None else size + pads[i] + pads[n + i] - (kernel[i] - 1) * dilations[i] - 1
        if span is not None and ctx.attr("ceil_mode", 0) and -(-span // strides[i]) * strides[i] >= size + pads[i]:
            # ONNX Runtime drops a last window that starts after the input (in the right padding
            # or past it), as torch does; onnx 1.23's shape inference counts it. ORT folds this
            # rule's matrix to its kernel's width, which contradicts dY's inferred width, and
            # the session does not load (it does with constant folding off).
            raise GradientError(f"AveragePool node '{node.name}': with ceil_mode=1 the last window on spatial axis {i} "
                                "starts after the input, where onnx and ONNX Runtime disagree on the output size; "
                                "pad less or use ceil_mode=0")

    def apply(axis: int, basis: int, eye: V) -> V:
        i = axis - 2

        def along(values: list[int], rest: int) -> list[int]:
            return [values[i] if j == i else rest for j in range(n)]

        return ctx.op("AveragePool", eye, kernel_shape=along(kernel, 1), strides=along(strides, 1),
                      pads=along(pads[:n], 0) + along(pads[n:], 0),
                      dilations=along(dilations, 1) if any(d != 1 for d in dilations) else None,
                      ceil_mode=ctx.attr("ceil_mode", 0), count_include_pad=ctx.attr("count_include_pad", 0))

    return separable_adjoint(ctx, dy, x, list(range(2, n + 2)), apply)


def _ceil_adds_windows(ctx: Ctx, x: V, kernel: list[int], geometry: tuple) -> bool:
    """Whether ceil_mode may add a last, partial window on some axis: unless every spatial dim
    is static and the strides tile the padded input exactly (timm's ResNet-D shortcut,
    ``AvgPool2d(2, ceil_mode=True)`` on even maps, has no partial window)."""
    strides, pads, dilations = geometry
    n = len(kernel)
    sizes = ctx.dims(x)[2:]
    return any(size is None or (size + pads[i] + pads[n + i] - (kernel[i] - 1) * dilations[i] - 1) % strides[i]
               for i, size in enumerate(sizes))


@register("AveragePool", opsets=(11, None))
def average_pool(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """The box adjoint (ConvTranspose with a ``1/area`` kernel); where ceil_mode adds a partial
    window, or with dynamic channels, the separable form, whose windows and divisors need no
    case analysis (its MatMuls cost ``in * out`` per row of each axis, so the box form stays
    where it applies)."""
    x = ctx.input(0)
    kernel = ctx.attr("kernel_shape")
    channels = ctx.dims(x)[1]
    geometry = _geometry(ctx, node, kernel)
    if channels is None or (ctx.attr("ceil_mode", 0) and _ceil_adds_windows(ctx, x, kernel, geometry)):
        return (_separable_average_pool(ctx, node, dy, kernel),)
    _, pads, dilations = geometry
    area = float(np.prod(kernel))
    if any(pads) and not ctx.attr("count_include_pad", 0):  # per-window divisors
        ones = ctx.op("ConstantOfShape", ctx.shape(x), value=ir.tensor(np.ones((1,), dtype=ctx.np_dtype(x))))
        fraction = ctx.op("AveragePool", ones, kernel_shape=kernel, strides=ctx.attr("strides"), pads=pads,
                          dilations=dilations if any(d != 1 for d in dilations) else None, count_include_pad=1)
        dy = ctx.op("Div", dy, ctx.op("Mul", fraction, ctx.scalar(area, x)))
        area = 1.0
    box = ctx.const(np.full([channels, 1, *kernel], 1.0 / area), x.dtype)
    return (_data_grad(ctx, node, dy, box, kernel, channels),)


@register("GlobalAveragePool")
def global_average_pool(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    spread = ctx.op("Expand", dy, ctx.shape(x))
    return (ctx.op("Div", spread, ctx.count_ratio(x, node.outputs[0], x)),)
