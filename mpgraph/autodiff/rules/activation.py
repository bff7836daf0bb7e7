"""Gradient rules for the piecewise and smooth activations exporters emit as single ops.

MobileNetV3 exports HardSwish and HardSigmoid, YOLO-style backbones Mish, Keras Softsign,
ThresholdedRelu and Celu. Each rule is the derivative of the op's ONNX definition; at the kinks
(measure zero) it takes torch's side, so the gradients match ``torch.autograd`` bit for bit in
direction.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


def _between(ctx: Ctx, x: V, lo: float, hi: float) -> V:
    """``lo < x < hi`` as a 0/1 mask in ``x``'s dtype."""
    inside = ctx.op("And", ctx.op("Greater", x, ctx.scalar(lo, x)), ctx.op("Less", x, ctx.scalar(hi, x)))
    return ctx.op("Cast", inside, to=x.dtype)


@register("HardSigmoid", opsets=(6, None))
def hard_sigmoid(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = max(0, min(1, alpha*x + beta)): slope alpha strictly inside the linear band."""
    x = ctx.input(0)
    alpha, beta = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    band = _between(ctx, ctx.op("Add", ctx.op("Mul", x, ctx.scalar(alpha, x)), ctx.scalar(beta, x)), 0.0, 1.0)
    return (ctx.op("Mul", dy, ctx.op("Mul", band, ctx.scalar(alpha, x))),)


@register("HardSwish", opsets=(14, None))
def hard_swish(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x * hardsigmoid(x; 1/6, 1/2): 0 below -3, x/3 + 1/2 on [-3, 3], 1 above 3 (torch's sides)."""
    x = ctx.input(0)
    ramp = ctx.op("Add", ctx.op("Mul", x, ctx.scalar(1.0 / 3.0, x)), ctx.scalar(0.5, x))
    above = ctx.op("Greater", x, ctx.scalar(3.0, x))
    below = ctx.op("Less", x, ctx.scalar(-3.0, x))
    slope = ctx.op("Where", above, ctx.scalar(1.0, x), ctx.op("Where", below, ctx.scalar(0.0, x), ramp))
    return (ctx.op("Mul", dy, slope),)


@register("Mish", opsets=(18, None))
def mish(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x * tanh(softplus(x)); dy/dx = t + x * (1 - t^2) * sigmoid(x) with t = tanh(softplus(x))."""
    x = ctx.input(0)
    t = ctx.op("Tanh", ctx.op("Softplus", x))
    sech2 = ctx.op("Sub", ctx.scalar(1.0, x), ctx.op("Mul", t, t))
    slope = ctx.op("Add", t, ctx.op("Mul", ctx.op("Mul", x, sech2), ctx.op("Sigmoid", x)))
    return (ctx.op("Mul", dy, slope),)


@register("Softsign")
def softsign(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x / (1 + |x|); dy/dx = 1 / (1 + |x|)^2."""
    x = ctx.input(0)
    denom = ctx.op("Add", ctx.scalar(1.0, x), ctx.op("Abs", x))
    return (ctx.op("Div", dy, ctx.op("Mul", denom, denom)),)


@register("Celu", opsets=(12, None))
def celu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = max(0, x) + min(0, alpha*(exp(x/alpha) - 1)); for x <= 0, dy/dx = exp(x/alpha) = y/alpha + 1."""
    x, y = ctx.input(0), node.outputs[0]
    alpha = ctx.attr("alpha", 1.0)
    negative = ctx.op("Add", ctx.op("Mul", y, ctx.scalar(1.0 / alpha, x)), ctx.scalar(1.0, x))
    positive = ctx.op("Greater", x, ctx.scalar(0.0, x))
    return (ctx.op("Where", positive, dy, ctx.op("Mul", dy, negative)),)


@register("ThresholdedRelu", opsets=(10, None))
def thresholded_relu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x where x > alpha, else 0."""
    x = ctx.input(0)
    above = ctx.op("Greater", x, ctx.scalar(ctx.attr("alpha", 1.0), x))
    return (ctx.op("Mul", dy, ctx.op("Cast", above, to=x.dtype)),)


@register("Swish", opsets=(24, None))
def swish(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x * sigmoid(alpha*x); dy/dx = s + alpha*x*s*(1 - s)."""
    x = ctx.input(0)
    alpha = ctx.attr("alpha", 1.0)
    ax = ctx.op("Mul", x, ctx.scalar(alpha, x))
    s = ctx.op("Sigmoid", ax)
    slope = ctx.op("Add", s, ctx.op("Mul", ax, ctx.op("Mul", s, ctx.op("Sub", ctx.scalar(1.0, x), s))))
    return (ctx.op("Mul", dy, slope),)


@register("Sin", opsets=(7, None))
def sin(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Mul", dy, ctx.op("Cos", ctx.input(0))),)


@register("Cos", opsets=(7, None))
def cos(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Neg", ctx.op("Mul", dy, ctx.op("Sin", ctx.input(0)))),)


@register("Shrink", opsets=(9, None))
def shrink(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """y = x - bias above lambd, x + bias below -lambd, else 0: slope 1 outside [-lambd, lambd]."""
    x = ctx.input(0)
    outside = ctx.op("Greater", ctx.op("Abs", x), ctx.scalar(ctx.attr("lambd", 0.5), x))
    return (ctx.op("Mul", dy, ctx.op("Cast", outside, to=x.dtype)),)
