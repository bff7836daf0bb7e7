"""Gradient rules for Softmax, LogSoftmax, LayerNormalization, RMSNormalization, BatchNormalization and LRN."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register
from mpgraph.errors import GradientError

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


@register("Softmax", opsets=(13, None))
def softmax(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """``dx = y * (dy - sum(dy * y))`` over the axis.

    Attention (``o = MatMul(y, v)`` the only consumer of ``y``, softmax over the last axis)
    takes the row sums from ``o`` instead, as FlashAttention does: ``dy = do @ v^T``, so
    ``sum_k dy_ik y_ik = sum_k y_ik (do_i . v_k) = do_i . o_i``, a product over the head
    dimension instead of the key dimension. On the H200 GPT that skips a Mul and a ReduceSum
    over the float32 ``[batch, heads, T, T]`` tensor, about 0.5 GB a layer.
    """
    y = node.outputs[0]
    axis = ctx.attr("axis", -1)
    attention = _attention_output(ctx, node, axis)
    if attention is not None:
        o, do = attention
        dot = ctx.op("ReduceSum", ctx.op("Mul", do, o), ctx.ints([-1]), keepdims=1)
        last = y.shape[-1] if y.shape is not None else None
        if isinstance(last, int):
            # [rows, T] - [rows, 1]: ORT CUDA's per-channel broadcast kernel. The [..., T] -
            # [..., 1] form takes its generic broadcast path (about 2x the time on the H200
            # GPT's [8, 16, 512, 512]); the Reshapes are views.
            rows = ctx.op("Sub", ctx.op("Reshape", dy, ctx.ints([-1, last])), ctx.op("Reshape", dot, ctx.ints([-1, 1])))
            return (ctx.op("Mul", y, ctx.op("Reshape", rows, ctx.shape(y))),)
    else:
        dot = ctx.op("ReduceSum", ctx.op("Mul", dy, y), ctx.ints([axis]), keepdims=1)
    return (ctx.op("Mul", y, ctx.op("Sub", dy, dot)),)


def _attention_output(ctx: Ctx, node: ir.Node, axis: int) -> tuple[V, V] | None:
    """``(o, do)`` when the Softmax output's only consumer is ``o = MatMul(y, v)`` (``y`` not
    also ``v``), the axis is the last one of a rank >= 2 output, and ``do`` is known."""
    y = node.outputs[0]
    rank = len(y.shape) if y.shape is not None else None
    if rank is None or rank < 2 or axis % rank != rank - 1 or y.is_graph_output():
        return None
    consumers = {use.node for use in y.uses() if use.node.metadata_props.get(NODE_ROLE) != Role.BACKWARD}
    if len(consumers) != 1:
        return None
    (matmul,) = consumers
    if matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx") or list(matmul.inputs).count(y) != 1 or matmul.inputs[0] is not y:
        return None
    v, o = matmul.inputs[1], matmul.outputs[0]
    # No broadcasting over the leading dims: each row of ``y`` meets exactly one row of ``do``.
    if v is None or v.shape is None or len(v.shape) != rank or any(
        not (isinstance(a, int) and a == b) and not (isinstance(a, ir.SymbolicDim) and a.value is not None and a == b)
        for a, b in zip(list(y.shape)[:-2], list(v.shape)[:-2], strict=True)
    ):
        return None
    do = ctx.gradient_of(o)
    return (o, do) if do is not None else None


@register("LogSoftmax", opsets=(13, None))
def log_softmax(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    y = node.outputs[0]
    total = ctx.op("ReduceSum", dy, ctx.ints([ctx.attr("axis", -1)]), keepdims=1)
    return (ctx.op("Sub", dy, ctx.op("Mul", ctx.op("Exp", y), total)),)


@register("LayerNormalization", opsets=(17, None), outputs=3)
def layer_norm(ctx: Ctx, node: ir.Node, dy: V, *_: V | None) -> tuple:
    """With ``xhat = (x - mean) * inv_std`` and ``dxhat = dy * scale``:
    ``dx = inv_std * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``,
    ``dscale = sum(dy * xhat)`` and ``dbias = sum(dy)`` over the leading axes.

    ``inv_std`` is the node's InvStdDev output (the driver adds it). ``xhat`` is recomputed by a
    second LayerNormalization with unit scale and no bias where the scale's shape is static:
    one fused pass over ``x`` instead of ``Sub`` and ``Mul`` (12 nodes a LayerNorm, was 13).
    """
    x, scale = ctx.input(0), ctx.input(1)
    bias = ctx.optional_input(2)
    rank = ctx.rank(x)
    axis = ctx.attr("axis", -1) % rank
    axes = ctx.ints(range(axis, rank))
    dbias = ctx.unbroadcast(dy, bias, x.shape) if bias is not None and ctx.needs(2) else None
    if not (ctx.needs(0) or ctx.needs(1)):
        return None, None, dbias
    inv_std = node.outputs[2]
    if inv_std.dtype != x.dtype:  # stash_type keeps the statistics in fp32
        inv_std = ctx.op("Cast", inv_std, to=x.dtype)
    dims = ctx.dims(scale)
    if dims and all(d is not None for d in dims):
        ones = ctx.const(np.ones(dims), x.dtype)
        xhat = ctx.op("LayerNormalization", x, ones, axis=axis, epsilon=ctx.attr("epsilon", 1e-5),
                      stash_type=ctx.attr("stash_type", 1))
    else:
        mean = node.outputs[1]
        if mean.dtype != x.dtype:
            mean = ctx.op("Cast", mean, to=x.dtype)
        xhat = ctx.op("Mul", ctx.op("Sub", x, mean), inv_std)
    dx = None
    if ctx.needs(0):
        dxhat = ctx.op("Mul", dy, scale)
        m1 = ctx.op("ReduceMean", dxhat, axes, keepdims=1)
        m2 = ctx.op("ReduceMean", ctx.op("Mul", dxhat, xhat), axes, keepdims=1)
        centered = ctx.op("Sub", ctx.op("Sub", dxhat, m1), ctx.op("Mul", xhat, m2))
        dx = ctx.op("Mul", inv_std, centered)
    dscale = ctx.unbroadcast(ctx.op("Mul", dy, xhat), scale, x.shape) if ctx.needs(1) else None
    return dx, dscale, dbias


@register("RMSNormalization", opsets=(23, None))
def rms_norm(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """With ``r = 1 / sqrt(mean(x^2) + eps)``, ``xhat = x * r`` and ``dxhat = dy * scale``:
    ``dx = r * (dxhat - xhat * mean(dxhat * xhat))`` and ``dscale = sum(dy * xhat)`` over the
    broadcast axes.

    ``r`` is computed in the stash type where it is wider than ``x`` (float32 for a float16 or
    bfloat16 ``x``, as the forward does); never narrower: ORT CPU keeps a float64
    RMSNormalization in float64 under the default ``stash_type`` 1.
    """
    x, scale = ctx.input(0), ctx.input(1)
    rank = ctx.rank(x)
    axes = ctx.ints(range(ctx.attr("axis", -1) % rank, rank))
    stash = ir.DataType(ctx.attr("stash_type", 1))
    wide = ctx.op("Cast", x, to=stash) if x.dtype is not None and stash.itemsize > x.dtype.itemsize else x
    mean_square = ctx.op("ReduceMean", ctx.op("Mul", wide, wide), axes, keepdims=1)
    r = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", mean_square, ctx.scalar(ctx.attr("epsilon", 1e-5), wide))))
    if wide is not x:
        r = ctx.op("Cast", r, to=x.dtype)
    xhat = ctx.op("Mul", x, r)
    dx = None
    if ctx.needs(0):
        dxhat = ctx.op("Mul", dy, scale)
        m = ctx.op("ReduceMean", ctx.op("Mul", dxhat, xhat), axes, keepdims=1)
        dx = ctx.op("Mul", r, ctx.op("Sub", dxhat, ctx.op("Mul", xhat, m)))
    dscale = ctx.unbroadcast(ctx.op("Mul", dy, xhat), scale, x.shape) if ctx.needs(1) else None
    return dx, dscale


@register("BatchNormalization", opsets=(15, None))
def batch_norm(ctx: Ctx, node: ir.Node, dy: V, *_: V | None) -> tuple:
    """With ``c = x - mean``, ``r = 1/sqrt(var + eps)``, ``g = scale * r`` and sums over
    (N, spatial) of count ``n``: ``dbias = sum(dy)``, ``dscale = r * sum(dy * c)``, and in
    training mode ``dx = g * (dy - sum(dy)/n) - c * (g * r^2 * sum(dy * c)/n)``.

    Written so that the two batch sums serve all three gradients and the normalized input is
    never materialized: 11 full-tensor passes where the textbook form takes 14.

    In eval mode, ``mean`` and ``var`` get ``-g * sum(dy)`` and ``-g * r^2 * sum(dy * c) / 2``
    where they are computed from what trains: torch's dynamo exporter writes a BatchNorm
    without running statistics (``track_running_stats=False``) as ReduceMeans feeding the
    eval-form node (without these, the conv weight gradient before it was off by 2.0 to 2.4
    times its norm).
    """
    x, scale, mean_in, var_in = ctx.input(0), ctx.input(1), ctx.input(3), ctx.input(4)
    rank = ctx.rank(x)
    axes = ctx.ints([0, *range(2, rank)])
    column = ctx.ints([-1] + [1] * (rank - 2))
    flat = ctx.ints([-1])
    eps = ctx.scalar(ctx.attr("epsilon", 1e-5), x)
    training = ctx.attr("training_mode", 0)
    if training:  # batch statistics, recomputed (ONNX has no saved-statistics outputs)
        centered = ctx.op("Sub", x, ctx.op("ReduceMean", x, axes, keepdims=1))
        var = ctx.op("ReduceMean", ctx.op("Mul", centered, centered), axes, keepdims=1)
    else:
        centered = ctx.op("Sub", x, ctx.op("Reshape", mean_in, column))
        var = ctx.op("Reshape", var_in, column)
    inv_std = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, eps)))
    gain = ctx.op("Mul", ctx.op("Reshape", scale, column), inv_std)
    dmean_needed, dvar_needed = not training and ctx.needs(3), not training and ctx.needs(4)
    need_dy_sum = ctx.needs(2) or (ctx.needs(0) and training) or dmean_needed
    need_dyc_sum = ctx.needs(1) or (ctx.needs(0) and training) or dvar_needed
    dy_sum = ctx.op("ReduceSum", dy, axes, keepdims=1) if need_dy_sum else None
    dyc_sum = ctx.op("ReduceSum", ctx.op("Mul", dy, centered), axes, keepdims=1) if need_dyc_sum else None
    dx = None
    if ctx.needs(0) and training:
        assert dy_sum is not None and dyc_sum is not None
        inv_count = ctx.op("Reciprocal", ctx.count_ratio(x, dy_sum, x))
        dy_mean = ctx.op("Mul", dy_sum, inv_count)
        coeff = ctx.op("Mul", ctx.op("Mul", gain, ctx.op("Mul", inv_std, inv_std)), ctx.op("Mul", dyc_sum, inv_count))
        dx = ctx.op("Sub", ctx.op("Mul", gain, ctx.op("Sub", dy, dy_mean)), ctx.op("Mul", centered, coeff))
    elif ctx.needs(0):
        dx = ctx.op("Mul", dy, gain)
    dscale = ctx.op("Reshape", ctx.op("Mul", dyc_sum, inv_std), flat) if ctx.needs(1) else None
    dbias = ctx.op("Reshape", dy_sum, flat) if ctx.needs(2) else None
    dmean = ctx.op("Reshape", ctx.op("Neg", ctx.op("Mul", gain, dy_sum)), ctx.shape(mean_in)) if dmean_needed else None
    dvar = None
    if dvar_needed:
        half = ctx.op("Mul", ctx.op("Mul", gain, ctx.op("Mul", inv_std, inv_std)), ctx.scalar(-0.5, x))
        dvar = ctx.op("Reshape", ctx.op("Mul", half, dyc_sum), ctx.shape(var_in))
    return dx, dscale, dbias, dmean, dvar


def _channel_window_sum(ctx: Ctx, x: V, size: int, before: int, channels: int) -> V:
    """sum over channels c-before .. c-before+size-1 of x, as a Conv over [N, 1, C, rest]."""
    folded = ctx.op("Reshape", x, ctx.ints([0, 1, channels, -1]))
    ones = ctx.const(np.ones((1, 1, size, 1)), x.dtype)
    summed = ctx.op("Conv", folded, ones, pads=[before, 0, size - 1 - before, 0])
    return ctx.op("Reshape", summed, ctx.shape(x))


@register("LRN", opsets=(13, None))
def lrn(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x * s^-beta, s = bias + alpha/size * window_sum(x^2)."""
    x = ctx.input(0)
    size, channels = ctx.attr("size"), ctx.dims(x)[1]
    if channels is None:
        raise GradientError(f"LRN node '{node.name}': the channel dim must be static")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    before = (size - 1) // 2
    s = ctx.op("Add", ctx.scalar(bias, x), ctx.op(
        "Mul", _channel_window_sum(ctx, ctx.op("Mul", x, x), size, before, channels), ctx.scalar(alpha / size, x)))
    direct = ctx.op("Mul", dy, ctx.op("Pow", s, ctx.scalar(-beta, x)))
    term = ctx.op("Mul", ctx.op("Mul", dy, x), ctx.op("Pow", s, ctx.scalar(-beta - 1.0, x)))
    spread = _channel_window_sum(ctx, term, size, size - 1 - before, channels)  # the adjoint window
    return (ctx.op("Sub", direct, ctx.op("Mul", x, ctx.op("Mul", spread, ctx.scalar(2 * alpha * beta / size, x)))),)
