"""Gradient rules for MatMul and Gemm, emitted as Gemm with transA/transB where 2-D."""

from __future__ import annotations

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


def _swap_last(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


@register("MatMul")
def matmul(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    a, b = ctx.input(0), ctx.input(1)
    y = node.outputs[0]
    ra, rb = ctx.rank(a), ctx.rank(b)
    da = db = None
    if rb == 1:  # (..., M, K) @ (K) -> (..., M); also the 1-D dot product
        ddy = ctx.op("Unsqueeze", dy, ctx.ints([-1]))
        da = ctx.op("Mul", ddy, b) if ctx.needs(0) else None
        db = ctx.unbroadcast(ctx.op("Mul", a, ddy), b, a.shape) if ctx.needs(1) else None
    elif ra == 1:  # (K) @ (..., K, N) -> (..., N)
        ddy = ctx.op("Unsqueeze", dy, ctx.ints([-2]))
        if ctx.needs(0):
            full = ctx.op("ReduceSum", ctx.op("Mul", b, ddy), ctx.ints([-1]), keepdims=0)
            da = ctx.unbroadcast(full, a, None if b.shape is None else ir.Shape(list(b.shape)[:-1]))
        db = ctx.op("Mul", ctx.op("Unsqueeze", a, ctx.ints([-1])), ddy) if ctx.needs(1) else None
    elif rb == 2:  # batch folded into rows: plain Gemm, no Transpose
        dy2 = dy if ra == 2 else ctx.op("Flatten", dy, axis=ra - 1)
        if ctx.needs(0):
            da = ctx.op("Gemm", dy2, b, transB=1)
            da = da if ra == 2 else ctx.op("Reshape", da, ctx.shape(a))
        if ctx.needs(1):
            a2 = a if ra == 2 else ctx.op("Flatten", a, axis=ra - 1)
            db = ctx.op("Gemm", a2, dy2, transA=1)
    else:  # batched: transpose the last two dims, then sum broadcast batch dims away
        batch = None if y.shape is None or a.shape is None or b.shape is None else list(y.shape)[:-2]
        if ctx.needs(0):
            da = ctx.op("MatMul", dy, ctx.op("Transpose", b, perm=_swap_last(rb)))
            da = ctx.unbroadcast(da, a, None if batch is None else ir.Shape(batch + list(a.shape or ())[-2:]))
        if ctx.needs(1):
            db = ctx.op("MatMul", ctx.op("Transpose", a, perm=_swap_last(ra)), dy)
            db = ctx.unbroadcast(db, b, None if batch is None else ir.Shape(batch + list(b.shape or ())[-2:]))
    return da, db


@register("Gemm")
def gemm(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    a, b = ctx.input(0), ctx.input(1)
    c = ctx.optional_input(2)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    da = db = dc = None
    if ctx.needs(0):  # dA' = alpha dY B'^T
        da = (ctx.op("Gemm", b, dy, transA=tb, transB=1, alpha=alpha) if ta
              else ctx.op("Gemm", dy, b, transB=1 - tb, alpha=alpha))
    if ctx.needs(1):  # dB' = alpha A'^T dY
        db = (ctx.op("Gemm", dy, a, transA=1, transB=ta, alpha=alpha) if tb
              else ctx.op("Gemm", a, dy, transA=1 - ta, alpha=alpha))
    if c is not None and ctx.needs(2):
        scaled = dy if beta == 1.0 else ctx.op("Mul", dy, ctx.scalar(beta, c))
        dc = ctx.unbroadcast(scaled, c, node.outputs[0].shape)
    return da, db, dc
