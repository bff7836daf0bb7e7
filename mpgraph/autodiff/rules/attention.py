"""Gradient rules for the transformer ops exporters write at opset 23: Attention and RotaryEmbedding.

torch's dynamo exporter writes ``F.scaled_dot_product_attention`` as ONNX ``Attention`` and
mpgraph's canonicalisation writes rotary embeddings as ``RotaryEmbedding``. Attention's
backward recomputes the probabilities from Q and K (MatMul, Softmax) instead of reading the
``[batch, heads, Sq, Skv]`` tensor from the forward, as FlashAttention does; the lowering room
may fuse it. The KV cache (``past_key``/``past_value``, opset 24's ``nonpad_kv_seqlen``) and the
cache and debug outputs are for inference and are refused with the node named.
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

_CACHE_INPUTS = {4: "past_key", 5: "past_value", 6: "nonpad_kv_seqlen"}
_EXTRA_OUTPUTS = {1: "present_key", 2: "present_value", 3: "qk_matmul_output"}


@register("Attention", opsets=(23, None))
def attention(ctx: Ctx, node: ir.Node, dy: V, *extra: V | None) -> tuple:
    """With ``S = scale * Q K^T``, ``T = softcap * tanh(S / softcap)`` (``T = S`` without a
    softcap), ``P = softmax(T + bias)`` and ``Y = P V``:
    ``dV = P^T dY``, ``dT = P * (dY V^T - rowsum(dY * Y))``, ``dS = dT * (1 - (T / softcap)^2)``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; a float mask gets ``dT`` (un-broadcast).

    ``rowsum(dP * P) = rowsum(dY * Y)`` is FlashAttention's: a product over the head dim, not
    the key dim. GQA: query head ``g * reps + r`` reads kv head ``g``, so Q viewed as
    ``[B, Hkv, reps * Sq, D]`` meets K and V directly, and dK and dV sum over the ``reps``
    query heads inside their MatMul.
    """
    _refuse_cache(ctx, node, extra)
    hq, hkv = _num_heads(ctx, node)
    q, k, v, dy4, y4 = (_split_heads(ctx, t, h) for t, h in ((ctx.input(0), hq), (ctx.input(1), hkv),
                        (ctx.input(2), hkv), (dy, hq), (node.outputs[0], hq)))
    group, ungroup = _grouping(ctx, hq, hkv)
    scale = ctx.scalar(_scale(ctx, hq), q)
    softcap = ctx.attr("softcap", 0.0)
    t = ungroup(ctx.op("MatMul", group(ctx.op("Mul", q, scale)), _t(ctx, k)))
    if softcap > 0:
        tanh = ctx.op("Tanh", ctx.op("Mul", t, ctx.scalar(1.0 / softcap, t)))
        t = ctx.op("Mul", tanh, ctx.scalar(softcap, t))
    p = _probabilities(ctx, t, _bias(ctx, q, k))
    dv = ctx.op("MatMul", _t(ctx, group(p)), group(dy4)) if ctx.needs(2) else None
    dp = ungroup(ctx.op("MatMul", group(dy4), _t(ctx, v)))
    dt = ctx.op("Mul", p, ctx.op("Sub", dp, ctx.op("ReduceSum", ctx.op("Mul", dy4, y4), ctx.ints([-1]), keepdims=1)))
    ds = dt if softcap <= 0 else ctx.op("Mul", dt, ctx.op("Sub", ctx.scalar(1.0, t), ctx.op("Mul", tanh, tanh)))
    ds_scaled = group(ctx.op("Mul", ds, scale))
    dq = ungroup(ctx.op("MatMul", ds_scaled, k)) if ctx.needs(0) else None
    dk = ctx.op("MatMul", _t(ctx, ds_scaled), group(q)) if ctx.needs(1) else None
    mask = ctx.optional_input(3)
    dmask = ctx.unbroadcast(dt, mask, _scores_shape(ctx, hq)) if ctx.needs(3) and mask is not None else None
    return tuple(None if g is None else _merge_heads(ctx, g, ctx.input(0)) for g in (dq, dk, dv)) + (dmask,)


def _refuse_cache(ctx: Ctx, node: ir.Node, extra_dys: tuple[V | None, ...]) -> None:
    """The KV cache and the debug output have no gradient here: name the node and why."""
    for index, name in _CACHE_INPUTS.items():
        if ctx.optional_input(index) is not None:
            raise GradientError(
                f"Attention node '{node.name}': input {name} is a KV cache for inference and is not "
                "differentiated; export the training model without a cache"
            )
    for index, dy in enumerate(extra_dys, start=1):
        if dy is not None:
            raise GradientError(
                f"Attention node '{node.name}': output {_EXTRA_OUTPUTS[index]} feeds the loss, but only "
                "output Y is differentiated (the cache and qk_matmul_output are for inference)"
            )


def _num_heads(ctx: Ctx, node: ir.Node) -> tuple[int, int]:
    """``(q heads, kv heads)``: the attributes for 3-D inputs, dim 1 of 4-D ones."""
    if ctx.rank(ctx.input(0)) == 3:
        return ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
    hq, hkv = ctx.dims(ctx.input(0))[1], ctx.dims(ctx.input(1))[1]
    if hq is None or hkv is None:
        raise GradientError(f"Attention node '{node.name}': the head counts (dim 1 of Q and K) must be static")
    return hq, hkv


def _scale(ctx: Ctx, hq: int) -> float:
    """The product of Q's and K's factors ``sqrt(scale)``, each rounded to float32 as the
    function body computes them (``scale`` defaults to ``1/sqrt(head_size)``, in float32):
    ORT's float64 kernel matches it to 2e-16, the unrounded scale only to 1e-7."""
    scale = ctx.attr("scale")
    if scale is None:
        q = ctx.input(0)
        last = ctx.dims(q)[-1]
        if last is None:
            raise GradientError(f"Attention node '{ctx.node.name if ctx.node else '?'}': Q's last dim must be static")
        scale = 1.0 / math.sqrt(last // hq if ctx.rank(q) == 3 else last)
    root = float(np.float32(math.sqrt(np.float32(scale))))
    return root * root


def _split_heads(ctx: Ctx, x: V, heads: int) -> V:
    """``[B, S, H * D] -> [B, H, S, D]``; 4-D values are already so."""
    if ctx.rank(ctx.input(0)) == 4:
        return x
    return ctx.op("Transpose", ctx.op("Reshape", x, ctx.ints([0, 0, heads, -1])), perm=[0, 2, 1, 3])


def _merge_heads(ctx: Ctx, x: V, like: V) -> V:
    """The inverse of ``_split_heads`` for inputs of ``like``'s rank."""
    if ctx.rank(like) == 4:
        return x
    return ctx.op("Reshape", ctx.op("Transpose", x, perm=[0, 2, 1, 3]), ctx.ints([0, 0, -1]))


def _t(ctx: Ctx, x: V) -> V:
    return ctx.op("Transpose", x, perm=[0, 1, 3, 2])


def _grouping(ctx: Ctx, hq: int, hkv: int) -> tuple:
    """Views between ``[B, Hq, S, X]`` and GQA's ``[B, Hkv, reps * S, X]`` (identities for MHA)."""
    if hq == hkv:
        return (lambda x: x), (lambda x: x)
    if hq % hkv:
        raise GradientError(f"Attention node '{ctx.node.name if ctx.node else '?'}': q_num_heads {hq} "
                            f"is not a multiple of kv_num_heads {hkv}")
    return (lambda x: ctx.op("Reshape", x, ctx.ints([0, hkv, -1, 0])),
            lambda x: ctx.op("Reshape", x, ctx.ints([0, hq, -1, 0])))


def _bias(ctx: Ctx, q: V, k: V) -> V | None:
    """The additive bias: a causal upper triangle of -inf (offset 0: no cache) plus the mask
    (a boolean one as 0 / -inf, a float one as is)."""
    mask, parts = ctx.optional_input(3), []
    if ctx.attr("is_causal", 0):
        size = ctx.op("Concat", ctx.shape(q, 2, 3), ctx.shape(k, 2, 3), axis=0)
        neg_inf = ir.tensor(np.full((1,), -np.inf, dtype=ctx.np_dtype(q)))
        parts.append(ctx.op("Trilu", ctx.op("ConstantOfShape", size, value=neg_inf), ctx.const(np.int64(1)), upper=1))
    if mask is not None:
        keys = ctx.dims(ctx.input(1))[-2]
        if mask.shape is not None and isinstance(mask.shape[-1], int) and keys is not None and mask.shape[-1] != keys:
            raise GradientError(f"Attention node '{ctx.node.name if ctx.node else '?'}': a mask shorter than "
                                "the keys (padded by the op) is not differentiated")
        is_bool = mask.dtype == ir.DataType.BOOL
        parts.append(ctx.op("Where", mask, ctx.scalar(0.0, q), ctx.scalar(-np.inf, q)) if is_bool else mask)
    return None if not parts else parts[0] if len(parts) == 1 else ctx.op("Add", *parts)


def _probabilities(ctx: Ctx, t: V, bias: V | None) -> V:
    """``softmax(t + bias)`` in ``softmax_precision``, with the spec's zero rows where the
    mask leaves a query no key (Softmax alone gives NaN there)."""
    logits = t if bias is None else ctx.op("Add", t, bias)
    precision = ctx.attr("softmax_precision")
    if precision is not None and ir.DataType(precision) != t.dtype:
        logits = ctx.op("Cast", logits, to=ir.DataType(precision))
    p = ctx.op("Softmax", logits, axis=-1)
    if precision is not None and ir.DataType(precision) != t.dtype:
        p = ctx.op("Cast", p, to=t.dtype)
    if ctx.optional_input(3) is None:  # causal alone leaves every query its own key
        return p
    assert bias is not None
    empty = ctx.op("IsInf", ctx.op("ReduceMax", bias, ctx.ints([-1]), keepdims=1), detect_positive=0)
    return ctx.op("Where", empty, ctx.scalar(0.0, t), p)


def _scores_shape(ctx: Ctx, hq: int) -> ir.Shape:
    """``[B, Hq, Sq, Skv]`` from Q's and K's shapes (for un-broadcasting the mask's gradient)."""
    q, k = ctx.input(0), ctx.input(1)
    assert q.shape is not None and k.shape is not None
    seq = 1 if len(q.shape) == 3 else 2
    return ir.Shape([q.shape[0], hq, q.shape[seq], k.shape[seq]])


@register("RotaryEmbedding", opsets=(23, None))
def rotary_embedding(ctx: Ctx, node: ir.Node, dy: V) -> tuple:
    """Each pair ``(x1, x2)`` turns by ``[[cos, -sin], [sin, cos]]``, the rest passes: the
    transpose turns back, ``dx = RotaryEmbedding(dy, cos, -sin)`` with the same attributes.
    The caches are positions' functions, not trained (no gradient)."""
    attrs = {name: ctx.attr(name) for name in ("interleaved", "rotary_embedding_dim", "num_heads")}
    back = ctx.op("RotaryEmbedding", dy, ctx.input(1), ctx.op("Neg", ctx.input(2)), ctx.optional_input(3), **attrs)
    return back, None, None, None
