"""Gradient rules for elementwise arithmetic and activations (the driver un-broadcasts)."""

from __future__ import annotations

import math

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.fuse_patterns import masked_softmax_input
from mpgraph.autodiff.registry import register

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


@register("Add", broadcast=True)
def add(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return dy, dy


@register("Sum", broadcast=True)
def sum_(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return tuple(dy for _ in node.inputs)


@register("Sub", broadcast=True)
def sub(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return dy, ctx.op("Neg", dy) if ctx.needs(1) else None


@register("Mul", broadcast=True)
def mul(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    a, b = ctx.input(0), ctx.input(1)
    return (
        ctx.op("Mul", dy, b) if ctx.needs(0) else None,
        ctx.op("Mul", dy, a) if ctx.needs(1) else None,
    )


@register("Div", broadcast=True)
def div(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    b = ctx.input(1)
    da = ctx.op("Div", dy, b)
    # d(a/b)/db = -(a/b)/b = -y/b, reusing the forward output.
    return da, ctx.op("Neg", ctx.op("Mul", da, node.outputs[0])) if ctx.needs(1) else None


@register("Neg")
def neg(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Neg", dy),)


@register("Pow", broadcast=True)
def pow_(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    a, b = ctx.input(0), ctx.input(1)
    bf = b if b.dtype == a.dtype else ctx.op("Cast", b, to=a.dtype)
    da = db = None
    if ctx.needs(0):
        if ctx.const_float(b) == 2.0 and b.shape is not None and len(b.shape) == 0:
            da = ctx.op("Mul", dy, ctx.op("Mul", a, ctx.scalar(2.0, a)))
        else:
            pw = ctx.op("Pow", a, ctx.op("Sub", bf, ctx.scalar(1.0, a)))
            da = ctx.op("Mul", dy, ctx.op("Mul", bf, pw))
    if ctx.needs(1):
        db = ctx.op("Mul", dy, ctx.op("Mul", node.outputs[0], ctx.op("Log", a)))
    return da, db


@register("Reciprocal")
def reciprocal(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    y = node.outputs[0]
    return (ctx.op("Neg", ctx.op("Mul", dy, ctx.op("Mul", y, y))),)


@register("Sqrt")
def sqrt(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    y = node.outputs[0]
    return (ctx.op("Div", ctx.op("Mul", dy, ctx.scalar(0.5, y)), y),)


@register("Exp")
def exp(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Mul", dy, node.outputs[0]),)


@register("Log")
def log(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Div", dy, ctx.input(0)),)


@register("Tanh")
def tanh(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    y = node.outputs[0]
    return (ctx.op("Mul", dy, ctx.op("Sub", ctx.scalar(1.0, y), ctx.op("Mul", y, y))),)


@register("Sigmoid")
def sigmoid(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    y = node.outputs[0]
    return (ctx.op("Mul", dy, ctx.op("Mul", y, ctx.op("Sub", ctx.scalar(1.0, y), y))),)


@register("Erf")
def erf(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    # dy * 2/sqrt(pi) / exp(x^2): 4 nodes (was 5 with Neg); an overflowing Exp gives the limit 0.
    # The square is a Mul: ORT CUDA's Pow with a low-precision base is ~7x slower.
    e = ctx.op("Exp", ctx.op("Mul", x, x))
    return (ctx.op("Div", ctx.op("Mul", dy, ctx.scalar(2.0 / math.sqrt(math.pi), x)), e),)


@register("Abs")
def abs_(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Mul", dy, ctx.op("Sign", ctx.input(0))),)


@register("Relu")
def relu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    positive = ctx.op("Greater", x, ctx.scalar(0.0, x))
    # Mul by the 0/1 mask: ORT's Where with a scalar branch is several times slower.
    return (ctx.op("Mul", dy, ctx.op("Cast", positive, to=x.dtype)),)


@register("LeakyRelu")
def leaky_relu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    alpha = ctx.attr("alpha", 0.01)
    positive = ctx.op("Greater", x, ctx.scalar(0.0, x))
    return (ctx.op("Where", positive, dy, ctx.op("Mul", dy, ctx.scalar(alpha, x))),)


@register("PRelu", broadcast=True)
def prelu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x, slope = ctx.input(0), ctx.input(1)
    positive = ctx.op("Greater", x, ctx.scalar(0.0, x))
    zero = ctx.scalar(0.0, x)
    dx = ctx.op("Where", positive, dy, ctx.op("Mul", dy, slope)) if ctx.needs(0) else None
    dslope = ctx.op("Where", positive, zero, ctx.op("Mul", dy, x)) if ctx.needs(1) else None
    return dx, dslope


@register("Elu")
def elu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x, y = ctx.input(0), node.outputs[0]
    negative = ctx.op("Add", y, ctx.scalar(ctx.attr("alpha", 1.0), x))
    positive = ctx.op("Greater", x, ctx.scalar(0.0, x))
    return (ctx.op("Where", positive, dy, ctx.op("Mul", dy, negative)),)


@register("Selu")
def selu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x, y = ctx.input(0), node.outputs[0]
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    negative = ctx.op("Add", y, ctx.scalar(alpha * gamma, x))
    positive = ctx.op("Greater", x, ctx.scalar(0.0, x))
    return (ctx.op("Where", positive, ctx.op("Mul", dy, ctx.scalar(gamma, x)), ctx.op("Mul", dy, negative)),)


@register("Softplus")
def softplus(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (ctx.op("Mul", dy, ctx.op("Sigmoid", ctx.input(0))),)


def erf_gelu_grad(ctx: Ctx, dy: V, x: V) -> V:
    """``dy * (cdf + x * pdf(x))`` for the erf GELU ``x * cdf``, ``cdf = 0.5 * (1 + erf(s))``,
    ``s = x / sqrt(2)``.

    ``x * pdf(x) = s * exp(-s^2) / sqrt(pi)``, written as ``s / exp(s^2)``: one node fewer than
    ``Exp(Neg(...))``, and an overflowing Exp gives the right limit 0. (``Pow(1/e, s^2)`` would
    be one node fewer again, but ORT CPU's Pow is 5.6x slower than Neg+Exp: 54 vs 9.7 ms on 4M
    floats, one thread.) The square is ``Mul(s, s)``: these nodes follow a low GELU into its
    dtype (``AssignPrecisionPass`` phase 5), and ORT CUDA's ``Pow`` with a bfloat16 base runs
    ``powf`` per element, 150 us per call on the H200 GPT's [8, 512, 4096] (1.2 ms a step for
    8 layers; a Mul is about 20 us). ``s`` is ``Div(x, sqrt 2)``, the torch exporters' form:
    the lowering's ``ErfGeluGrad`` computes these very terms (``mpgraph.lowering.gelu``).
    """
    scaled = ctx.op("Div", x, ctx.scalar(math.sqrt(2.0), x))
    cdf = ctx.op("Mul", ctx.scalar(0.5, x), ctx.op("Add", ctx.scalar(1.0, x), ctx.op("Erf", scaled)))
    ratio = ctx.op("Div", scaled, ctx.op("Exp", ctx.op("Mul", scaled, scaled)))
    slope = ctx.op("Add", cdf, ctx.op("Mul", ratio, ctx.scalar(1.0 / math.sqrt(math.pi), ratio)))
    return ctx.op("Mul", dy, slope)


@register("Gelu", opsets=(20, None))
def gelu(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    if ctx.attr("approximate", "none") != "tanh":
        return (erf_gelu_grad(ctx, dy, x),)
    # The lowering's TanhGeluGrad (mpgraph.lowering.gelu, csrc/gelu.cu) computes these very
    # ops and scalars, rounded step by step: change them together.
    half = ctx.scalar(0.5, x)
    c, k = math.sqrt(2.0 / math.pi), 0.044715
    x2 = ctx.op("Mul", x, x)
    inner = ctx.op("Mul", x, ctx.op("Add", ctx.scalar(c, x), ctx.op("Mul", x2, ctx.scalar(c * k, x))))
    t = ctx.op("Tanh", inner)
    dinner = ctx.op("Add", ctx.scalar(c, x), ctx.op("Mul", x2, ctx.scalar(3 * c * k, x)))
    sech2 = ctx.op("Sub", ctx.scalar(1.0, x), ctx.op("Mul", t, t))
    left = ctx.op("Mul", half, ctx.op("Add", ctx.scalar(1.0, x), t))
    grad = ctx.op("Add", left, ctx.op("Mul", ctx.op("Mul", half, x), ctx.op("Mul", sech2, dinner)))
    return (ctx.op("Mul", dy, grad),)


@register("Clip", opsets=(11, None))
def clip(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    lo = ctx.optional_input(1)
    hi = ctx.optional_input(2)
    inside = None
    for bound, op in ((lo, "GreaterOrEqual"), (hi, "LessOrEqual")):
        if bound is not None:
            test = ctx.op(op, x, bound)
            inside = test if inside is None else ctx.op("And", inside, test)
    return (dy if inside is None else ctx.op("Where", inside, dy, ctx.scalar(0.0, x)), None, None)


@register("Where", broadcast=True)
def where(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    cond, x = ctx.input(0), ctx.input(1)
    masked = masked_softmax_input(node)
    if masked is not None:
        # dy is already exactly 0 at the -inf logits (see fuse_patterns): skip a select over
        # the attention tensor ([8,16,512,512] float32 in the GPT benchmark: 128 MB a pass).
        return tuple(dy if i == masked else None for i in range(3))
    zero = ctx.scalar(0.0, x)
    return (
        None,
        ctx.op("Where", cond, dy, zero) if ctx.needs(1) else None,
        ctx.op("Where", cond, zero, dy) if ctx.needs(2) else None,
    )


@register("Expand", broadcast=True)
def expand(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return dy, None


@register("Identity")
def identity(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    return (dy,)


@register("Cast")
def cast(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    x = ctx.input(0)
    return (dy if x.dtype == node.outputs[0].dtype else ctx.op("Cast", dy, to=x.dtype),)


@register("CastLike", opsets=(15, None))
def cast_like(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Like Cast; the second input only names the dtype, so it gets no gradient."""
    x = ctx.input(0)
    return (dy if x.dtype == node.outputs[0].dtype else ctx.op("Cast", dy, to=x.dtype)), None


@register("Dropout", opsets=(12, None), outputs=2)
def dropout(ctx: Ctx, node: ir.Node, dy: V, dmask: V | None = None) -> tuple:
    x = ctx.input(0)
    ratio = ctx.optional_input(1)
    training = ctx.optional_input(2)
    if training is None or ctx.const_ints(training) == [0]:
        return dy, None, None
    keep = ctx.op("Cast", node.outputs[1], to=x.dtype)
    one = ctx.scalar(1.0, x)
    if ratio is None:
        scale = ctx.scalar(2.0, x)
    else:
        r = ratio if ratio.dtype == x.dtype else ctx.op("Cast", ratio, to=x.dtype)
        scale = ctx.op("Div", one, ctx.op("Sub", one, r))
    if ctx.const_ints(training) is None:  # decided at run time: eval mode passes dy through
        scale = ctx.op("Where", training, scale, one)
    return ctx.op("Mul", ctx.op("Mul", dy, keep), scale), None, None
