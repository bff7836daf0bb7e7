"""Gradient rules for NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

SoftmaxCrossEntropyLoss is NLL of LogSoftmax, so its rule chains the two: the NLL gradient
with respect to the log-probabilities, then the LogSoftmax gradient along the class axis.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.autodiff.registry import register

__all__: list[str] = []

V = ir.Value
Ctx = GradContext


def _nll_parts(ctx: Ctx, node: ir.Node, log_prob: V, dloss: V) -> tuple[V, V]:
    """``(one_hot, scale)`` with ``d loss / d log_prob = -one_hot * scale`` for NLL with
    optional class weights, ignore_index and reduction; ``scale`` broadcasts over the class
    axis (a scalar for an unweighted mean)."""
    labels = ctx.input(1)
    weights = ctx.optional_input(2)
    ignore = ctx.attr("ignore_index")
    weight = None
    safe = labels
    if ignore is not None:
        keep = ctx.op("Not", ctx.op("Equal", labels, ctx.const(np.asarray(ignore, dtype=ctx.np_dtype(labels)))))
        safe = ctx.op("Where", keep, labels, ctx.const(np.zeros((), dtype=ctx.np_dtype(labels))))
        weight = ctx.op("Cast", keep, to=log_prob.dtype)
    if weights is not None:
        picked = ctx.op("Gather", weights, safe)
        weight = picked if weight is None else ctx.op("Mul", weight, picked)
    on_off = ctx.const(np.asarray([0.0, 1.0]), log_prob.dtype)
    one_hot = ctx.op("OneHot", safe, ctx.shape(log_prob, 1, 2), on_off, axis=1)
    scale = dloss
    if ctx.attr("reduction", "mean") == "mean":
        count = (ctx.op("ReduceSum", weight, keepdims=0) if weight is not None
                 else ctx.op("Cast", ctx.op("Size", labels), to=log_prob.dtype))
        scale = ctx.op("Div", dloss, count)
    if weight is not None:
        scale = ctx.op("Mul", scale, weight)
    if ctx.attr("reduction", "mean") == "none" or weight is not None:
        scale = ctx.op("Unsqueeze", scale, ctx.ints([1]))
    return one_hot, scale


@register("NegativeLogLikelihoodLoss", opsets=(13, None))
def nll_loss(ctx: Ctx, node: ir.Node, dloss: V) -> tuple:
    one_hot, scale = _nll_parts(ctx, node, ctx.input(0), dloss)
    return ctx.op("Neg", ctx.op("Mul", one_hot, scale)), None, None


@register("SoftmaxCrossEntropyLoss", opsets=(13, None), outputs=2)
def softmax_cross_entropy(ctx: Ctx, node: ir.Node, dloss: V | None, dlog_prob: V | None = None) -> tuple:
    """``d logits = (softmax - one_hot) * scale`` when only the loss is differentiated: four
    passes over the ``[N, C]`` logits (OneHot, Exp, Sub, Mul) instead of seven through the
    NLL gradient (the one-hot's Mul and Neg, a ReduceSum over classes, and the LogSoftmax
    backward's Exp, Mul and Sub): 1.9 GB -> 1.2 GB a step on the GPT benchmark's float32
    [4096, 8192] logits. With a gradient for the log-probabilities too, the general chain.
    """
    log_prob = node.outputs[1]
    if dloss is not None and dlog_prob is None:
        one_hot, scale = _nll_parts(ctx, node, log_prob, dloss)
        return ctx.op("Mul", ctx.op("Sub", ctx.op("Exp", log_prob), one_hot), scale), None, None
    dlp = dlog_prob
    if dloss is not None:
        one_hot, scale = _nll_parts(ctx, node, log_prob, dloss)
        dlp = ctx.op("Add", ctx.op("Neg", ctx.op("Mul", one_hot, scale)), dlog_prob)
    total = ctx.op("ReduceSum", dlp, ctx.ints([1]), keepdims=1)
    return ctx.op("Sub", dlp, ctx.op("Mul", ctx.op("Exp", log_prob), total)), None, None
