"""Gradient rules for Conv and pooling.

Data gradients are ``ConvTranspose`` (the adjoint of a strided convolution, and vice versa for
ConvTranspose); the weight
gradient is a convolution of the input with the output gradient, batch and channels swapped
(stride and dilation swap roles); MaxPool routes gradients through its indices output.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register
from mpgraph.errors import GradientError

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


def _geometry(ctx: Ctx, node: ir.Node, kernel: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Strides, explicit pads (begin..., end...) and dilations of a conv/pool node."""
    x = node.inputs[0]
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
    """ConvTranspose of ``dy``, sized back to the forward input (output_padding or end Pad)."""
    x, y = node.inputs[0], node.outputs[0]
    strides, pads, dilations = _geometry(ctx, node, kernel)
    n = len(strides)
    xs, ys = ctx.dims(x)[2:], ctx.dims(y)[2:]
    attrs = dict(strides=strides, pads=pads, dilations=dilations, group=group)
    if all(v is not None for v in xs + ys):
        extra = [xs[i] - ((ys[i] - 1) * strides[i] - pads[i] - pads[n + i] + dilations[i] * (kernel[i] - 1) + 1) for i in range(n)]
        if all(0 <= e < max(strides[i], dilations[i]) for i, e in enumerate(extra)):
            return ctx.op("ConvTranspose", dy, w, output_padding=extra if any(extra) else None, **attrs)
    dx = ctx.op("ConvTranspose", dy, w, **attrs)
    missing = ctx.op("Sub", ctx.shape(x, 2), ctx.shape(dx, 2))
    pads_v = ctx.op("Concat", ctx.ints([0] * n), missing, axis=0)
    return ctx.op("Pad", dx, pads_v, None, ctx.ints(range(2, n + 2)))


def _weight_grad(ctx: Ctx, x: V, dy: V, w: V, geometry: tuple, kernel: list[int], group: int) -> V:
    """dW[m, c, k] = sum_{n, o} x[n, c, o*s + k*d - p] dy[n, m, o] of a convolution from x to
    dy's shape, as one grouped Conv (batch and channels swapped; stride and dilation swap)."""
    strides, pads, dilations = geometry
    n = len(strides)
    spatial = list(range(3, n + 3))
    m, cg = ctx.dims(w)[0], ctx.dims(w)[1]  # (out, in per group) of the convolution x -> dy
    if group == 1:
        xt = ctx.op("Transpose", x, perm=[1, 0, *range(2, n + 2)])
        dyt = ctx.op("Transpose", dy, perm=[1, 0, *range(2, n + 2)])
    else:  # channels (g, c) -> batch c, channels (g, n): one grouped conv
        xg = ctx.op("Reshape", x, ctx.op("Concat", ctx.shape(x, 0, 1), ctx.ints([group, cg]), ctx.shape(x, 2), axis=0))
        xt = ctx.op("Reshape", ctx.op("Transpose", xg, perm=[2, 1, 0, *spatial]),
                    ctx.op("Concat", ctx.ints([cg, -1]), ctx.shape(x, 2), axis=0))
        dyg = ctx.op("Reshape", dy, ctx.op("Concat", ctx.shape(dy, 0, 1), ctx.ints([group, m // group]), ctx.shape(dy, 2), axis=0))
        dyt = ctx.op("Reshape", ctx.op("Transpose", dyg, perm=[1, 2, 0, *spatial]),
                     ctx.op("Concat", ctx.ints([m, -1]), ctx.shape(dy, 2), axis=0))
    full = ctx.op("Conv", xt, dyt, strides=dilations, dilations=strides, pads=pads, group=group)
    return ctx.op("Slice", ctx.op("Transpose", full, perm=[1, 0, *range(2, n + 2)]),
                  ctx.ints([0] * n), ctx.ints(kernel), ctx.ints(range(2, n + 2)))


@register("Conv", opsets=(11, None))
def conv(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x, w = node.inputs[0], node.inputs[1]
    kernel = ctx.attr("kernel_shape") or ctx.dims(w)[2:]
    if any(k is None for k in kernel):
        raise GradientError(f"Conv node '{node.name}': kernel shape must be static")
    group = ctx.attr("group", 1)
    dx = _data_grad(ctx, node, dy, w, kernel, group) if ctx.needs(0) else None
    geometry = _geometry(ctx, node, kernel)
    dw = _weight_grad(ctx, x, dy, w, geometry, kernel, group) if ctx.needs(1) else None
    db = None
    if len(node.inputs) > 2 and ctx.needs(2):
        db = ctx.op("ReduceSum", dy, ctx.ints([0, *range(2, ctx.rank(x))]), keepdims=0)
    return dx, dw, db


@register("ConvTranspose", opsets=(11, None))
def conv_transpose(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """The adjoint of Conv: dX is a Conv of dY, dW the Conv weight gradient with x and dy swapped."""
    x, w = node.inputs[0], node.inputs[1]
    kernel = ctx.attr("kernel_shape") or ctx.dims(w)[2:]
    if ctx.attr("auto_pad", "NOTSET") != "NOTSET" or ctx.attr("output_shape") or any(k is None for k in kernel):
        raise GradientError(f"ConvTranspose node '{node.name}': only explicit pads and static kernels are supported")
    group = ctx.attr("group", 1)
    strides, pads, dilations = _geometry(ctx, node, kernel)
    attrs = dict(strides=strides, pads=pads, dilations=dilations, group=group)
    dx = ctx.op("Conv", dy, w, **attrs) if ctx.needs(0) else None
    dw = _weight_grad(ctx, dy, x, w, (strides, pads, dilations), kernel, group) if ctx.needs(1) else None
    db = None
    if len(node.inputs) > 2 and ctx.needs(2):
        db = ctx.op("ReduceSum", dy, ctx.ints([0, *range(2, ctx.rank(x))]), keepdims=0)
    return dx, dw, db


@register("MaxPool", opsets=(12, None), outputs=2)
def max_pool(ctx: Ctx, node: ir.Node, dy: V, *_: V | None) -> tuple:
    x, indices = node.inputs[0], node.outputs[1]
    if ctx.attr("storage_order", 0):
        raise GradientError(f"MaxPool node '{node.name}': storage_order=1 is not supported")
    flat = ctx.ints([-1])
    size = ctx.op("Reshape", ctx.op("Size", x), ctx.ints([1]))
    zeros = ctx.op("ConstantOfShape", size, value=ir.tensor(np.zeros((1,), dtype=x.dtype.numpy())))
    scattered = ctx.op("ScatterElements", zeros, ctx.op("Reshape", indices, flat),
                       ctx.op("Reshape", dy, flat), reduction="add")
    return (ctx.op("Reshape", scattered, ctx.shape(x)),)


@register("AveragePool", opsets=(11, None))
def average_pool(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = node.inputs[0]
    kernel = ctx.attr("kernel_shape")
    channels = ctx.dims(x)[1]
    if channels is None or ctx.attr("ceil_mode", 0):
        raise GradientError(f"AveragePool node '{node.name}': needs static channels and ceil_mode=0")
    _, pads, _ = _geometry(ctx, node, kernel)
    area = float(np.prod(kernel))
    if any(pads) and not ctx.attr("count_include_pad", 0):  # per-window divisors
        ones = ctx.op("ConstantOfShape", ctx.shape(x), value=ir.tensor(np.ones((1,), dtype=x.dtype.numpy())))
        fraction = ctx.op("AveragePool", ones, kernel_shape=kernel, strides=ctx.attr("strides"),
                          pads=pads, count_include_pad=1)
        dy = ctx.op("Div", dy, ctx.op("Mul", fraction, ctx.scalar(area, x)))
        area = 1.0
    box = ctx.const(np.full([channels, 1, *kernel], 1.0 / area), x.dtype)
    return (_data_grad(ctx, node, dy, box, kernel, channels),)


@register("GlobalAveragePool")
def global_average_pool(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = node.inputs[0]
    spread = ctx.op("Expand", dy, ctx.shape(x))
    return (ctx.op("Div", spread, ctx.count_ratio(x, node.outputs[0], x)),)
