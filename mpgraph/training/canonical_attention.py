"""The attention and rotary rules of ``CanonicalizeOpsPass``, and the helpers its other rules share.

Written-out attention (eager, or torch's SDPA decomposition and symbolic) becomes the standard
ONNX ``Attention`` (opset 23) with 4-D inputs, HF's written-out rotary embedding the standard
``RotaryEmbedding`` (23); see ``CanonicalizeOpsPass`` rules 4 and 5.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from mpgraph.io import min_ir_version

__all__ = ["ATTENTION_RULES", "ROTARY_RULES", "const_scalar", "drop_known_masks", "last_axis", "static_dims"]

logger = logging.getLogger(__name__)

_ANY = pattern.ANY_VALUE
#: A mask value at or below this is "never attend" (HF writes float32's lowest, SDPA -inf).
_MASKED = -1e30


def const_scalar(value: ir.Value | None, depth: int = 0) -> float | None:
    """A one-element float known before the graph runs: a constant, or Sqrt/Reciprocal/Div/
    Mul/Cast/CastLike of such (torch's SDPA writes ``Sqrt(CastLike(scale, q))``)."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        array = tensor.numpy()
        return float(array.reshape(-1)[0]) if array.size == 1 else None
    node = value.producer()
    if node is None or depth > 8 or node.domain not in ("", "ai.onnx"):
        return None
    args = [const_scalar(v, depth + 1) for v in node.inputs[:1 if node.op_type in ("Cast", "CastLike") else 2]]
    if any(a is None for a in args):
        return None
    a = args[0]
    assert a is not None
    if node.op_type in ("Cast", "CastLike"):
        return a
    if node.op_type == "Sqrt" and a >= 0:
        return math.sqrt(a)
    if node.op_type == "Reciprocal" and a != 0:
        return 1.0 / a
    b = args[1] if len(args) > 1 else None
    if node.op_type == "Mul" and b is not None:
        return a * b
    if node.op_type == "Div" and b:
        return a / b
    return None


def _known(value: ir.Value | None, limit: int = 64) -> np.ndarray | None:
    """The value of a mask known before the graph runs: a constant, or computed (by at most
    ``limit`` nodes, with onnx's reference evaluator) from constants and the shapes of
    statically shaped values (TorchScript's causal mask: Trilu over the scores' shape).
    ``None`` when it reads anything else, a float initializer of rank >= 1 (maybe trained) too."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is not None or value is None:
        return None if tensor is None else tensor.numpy()
    cone: dict[ir.Node, None] = {}
    feeds: dict[str, np.ndarray] = {}
    pending = [value]
    while pending:
        v = pending.pop()
        node = v.producer()
        if node is None:
            if v.is_graph_input() or not v.is_initializer() or v.const_value is None:
                return None
            if v.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) and len(v.shape or ()) >= 1:
                return None
            continue
        if node in cone or v.name in feeds:
            continue
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
            dims = static_dims(node.inputs[0])
            if dims is None or None in dims or not v.name:
                return None
            start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", len(dims))
            feeds[v.name] = np.array(dims[start:end], dtype=np.int64)
            continue
        if len(cone) >= limit or node.domain not in ("", "ai.onnx") or node.op_type in ("If", "Loop", "Scan"):
            return None
        cone[node] = None
        pending.extend(i for i in node.inputs if i is not None)
    return _evaluate(value, [n for n in value.graph or [] if n in cone] if value.graph else list(cone), feeds)


def _evaluate(value: ir.Value, nodes: list[ir.Node], feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    from onnx.reference import ReferenceEvaluator  # imported when a mask is computed

    graph = value.graph
    if graph is None or not value.name:
        return None
    inputs = [v for n in nodes for v in n.inputs if v is not None and v.name in feeds]
    inits = {v.name: v for n in nodes for v in n.inputs if v is not None and v.is_initializer() and v.name}
    view = ir.GraphView(list(dict.fromkeys(inputs)), [value], nodes=nodes, initializers=list(inits.values()),
                        opset_imports=dict(graph.opset_imports), name="mask")
    try:
        proto = ir.to_proto(ir.Model(view, ir_version=max(8, min_ir_version(graph.opset_imports))))  # type: ignore[arg-type]
        return np.asarray(ReferenceEvaluator(proto).run([value.name], feeds)[0])
    except Exception as e:  # noqa: BLE001 - the evaluator raises many types; this only recognises a form
        logger.info("mask '%s' not evaluated (%s): kept as an input", value.name, str(e).splitlines()[0] if str(e) else e)
        return None


def static_dims(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def last_axis(axes: ir.Value | None, x: ir.Value) -> bool:
    """Whether ``axes`` (a ReduceMean's) is exactly the last axis of ``x``."""
    tensor = ir.convenience.get_const_tensor(axes) if axes is not None else None
    rank = len(x.shape) if x.shape is not None else None
    if tensor is None or tensor.numpy().size != 1:
        return False
    axis = int(tensor.numpy().reshape(-1)[0])
    return axis == -1 or (rank is not None and axis == rank - 1)


# -- attention --------------------------------------------------------------------------------


def _scaled(op, x, scale, tag: str):
    return pattern.OrValue([op.Mul(x, scale), op.Div(x, scale), x], tag_var=tag, tag_values=["Mul", "Div", "None"])


class _EagerAttention(pattern.RewriteRuleClassBase):
    """``softmax(scale * Q K^T + mask) V`` written out (eager or torch's SDPA decomposition)."""

    def pattern(self, op, query, key, value, mask, mask2, cond, fill, q_scale, k_scale, qk_scale):
        key_t = pattern.OrValue(
            [op.Transpose(key, perm=[0, 1, 3, 2]),
             op.Reshape(op.Transpose(op.Reshape(key, _ANY), perm=[0, 2, 1]), _ANY, _outputs=["key_t3"]),
             op.Transpose(key, perm=[0, 2, 3, 1])],
            tag_var="key_format", tag_values=["BHSD", "BHSD3", "BSHD"])
        scores = op.MatMul(_scaled(op, query, q_scale, "q_scaling"), _scaled(op, key_t, k_scale, "k_scaling"))
        scores = _scaled(op, scores, qk_scale, "qk_scaling")
        scores = pattern.OrValue([op.Add(op.Add(scores, mask), mask2, _outputs=["masked_add2"]),
                                  op.Add(scores, mask, _outputs=["masked_add"]),
                                  op.Where(cond, scores, fill, _outputs=["masked_where"]),
                                  op.Where(cond, fill, scores, _outputs=["masked_fill"]), scores],
                                 tag_var="mask_style", tag_values=["add2", "add", "where", "where_masked", "none"])
        probs = op.Softmax(scores, axis=-1)
        probs = pattern.OrValue([op.Where(op.IsNaN(probs), 0.0, probs), probs])
        return op.MatMul(probs, value)

    def check(self, context, query, key, value, key_format, mask_style, mask=None, mask2=None, cond=None, fill=None,
              **kw):
        result = pattern.MatchResult()
        q, k, v = static_dims(query), static_dims(key), static_dims(value)
        if q is None or k is None or v is None or not len(q) == len(k) == len(v) == 4:
            return result.fail("Q, K and V must be 4-D with known rank", query)
        if key_format == "BSHD":
            k = [k[0], k[2], k[1], k[3]]
        if key_format == "BHSD3" and static_dims(kw.get("key_t3")) != [k[0], k[1], k[3], k[2]]:
            return result.fail("the 3-D transpose of K does not give [B, H, D, S]", key)
        if q[2] is None or q[1] is None or q[1] != k[1] or k[1] != v[1] or q[3] is None or q[3] != k[3] or k[2] != v[2]:
            return result.fail("Q, K and V heads or sizes do not agree", query)
        scale = 1.0
        for tag, name in (("q_scaling", "q_scale"), ("k_scaling", "k_scale"), ("qk_scaling", "qk_scale")):
            if kw.get(tag, "None") == "None":
                continue
            factor = const_scalar(kw.get(name))
            if factor is None or factor == 0:
                return result.fail(f"{name} is not a constant scalar", kw.get(name))
            scale *= factor if kw[tag] == "Mul" else 1.0 / factor
        self._scale = scale
        self._masks, self._causal, self._inverted = [], 0, False
        # A mask dim exporters left symbolic broadcasts when the masked scores keep their shape.
        masked = next((kw[n] for n in ("masked_add2", "masked_add", "masked_where", "masked_fill") if kw.get(n)), None)
        self._scores_kept = masked is not None and static_dims(masked) == [q[0], q[1], q[2], k[2]] and None not in q
        if mask_style in ("add", "add2"):
            return self._check_float_masks(result, [mask] + ([mask2] if mask_style == "add2" else []), query, q, k)
        if mask_style in ("where", "where_masked"):
            return self._check_bool_mask(result, cond, fill, q, k, inverted=mask_style == "where_masked")
        return result

    def _check_float_masks(self, result, masks, query, q, k):
        """Additive masks (T5 adds its position bias, then the causal or padding mask): one
        known to hide nothing goes, one known to be the causal triangle becomes is_causal."""
        arrays = [_known(mask) for mask in masks]
        for mask, array in zip(masks, arrays, strict=True):
            if mask.dtype != query.dtype or not self._fits(_mask_dims(mask, array), [q[0], q[1], q[2], k[2]]):
                return result.fail("the additive mask's type or shape does not fit the scores", mask)
        for mask, array in zip(masks, arrays, strict=True):
            if array is not None and not array.any():
                continue  # all zeros: no mask
            if array is not None and not self._causal and _is_causal(array <= _MASKED, array > _MASKED, array, q[2], k[2]):
                self._causal = 1
                continue
            self._masks.append(mask)
        return result

    def _check_bool_mask(self, result, cond, fill, q, k, inverted: bool):
        level = const_scalar(fill)
        if cond.dtype != ir.DataType.BOOL or level is None or level > _MASKED:
            return result.fail("Where(mask, scores, fill) needs a boolean mask and a fill of -inf", cond)
        known = _known(cond)
        if not self._fits(_mask_dims(cond, known), [q[0], q[1], q[2], k[2]]):
            return result.fail("the boolean mask's shape does not fit the scores", cond)
        kept = None if known is None else ~known if inverted else known
        if kept is not None and _is_causal(~kept, kept, None, q[2], k[2]):
            self._causal = 1
        else:
            self._masks = [cond]  # True: attend, as Attention reads a boolean mask
            self._inverted = inverted  # True: masked (masked_fill's), so Attention reads Not(cond)
        return result

    def _fits(self, dims: list[int | None] | None, target: list[int | None]) -> bool:
        """The mask broadcasts to the scores: known from its dims, or from the masked scores'."""
        if dims is None or len(dims) > 4 or dims[-1] != target[-1]:
            return False
        return _broadcasts(dims, target) or self._scores_kept

    def rewrite(self, op, query, key, value, key_format, **_):
        if key_format == "BSHD":
            key = op.Transpose(key, perm=[0, 2, 1, 3])
        rows = static_dims(query)[2]
        masks = list(self._masks)
        if masks and self._inverted:
            producer = masks[0].producer()
            negated = producer is not None and producer.op_type == "Not" and producer.domain in ("", "ai.onnx")
            masks = [producer.inputs[0]] if negated else [op.Not(_full_query_rows(op, masks[0], rows))]
        # Expanded before they are combined: a value the rewrite makes has no shape yet.
        masks = [_full_query_rows(op, m, rows) for m in masks]
        mask = None if not masks else masks[0] if len(masks) == 1 else op.Add(*masks)
        inputs = [query, key, value] + ([mask] if mask is not None else [])
        return op.Attention(*inputs, scale=float(np.float32(self._scale)), is_causal=self._causal)


def _mask_dims(mask: ir.Value, known: np.ndarray | None) -> list[int | None] | None:
    """The mask's dims: those of its value where it is known before the graph runs. A mask
    computed from shapes and expanded by a computed size has symbolic dims after shape
    inference, and stays computed where it is too large to fold (``FoldConstantSubgraphsPass``'s
    limit): transformers 5.17's BERT mask with no ``attention_mask``, ``Where(Expand(arange >=
    0, [B, 1, S, S]), 0, min)``, is ``[?, ?, 512, ?]`` at batch 8, sequence 512."""
    return list(known.shape) if known is not None else static_dims(mask)


def _full_query_rows(op, mask, rows: int | None):
    """ONNX Runtime (1.32, CPU) refuses a mask that broadcasts over the query positions
    ("inconsistent q_sequence_length (between attn_mask and Q)"), which the spec allows: such
    a mask (``[B, 1, 1, S]`` padding masks, rank 1, a symbolic dim that is 1 or ``rows``) is
    expanded to ``rows`` query rows."""
    dims = static_dims(mask)
    if dims is None or rows is None or (len(dims) >= 2 and dims[-2] == rows):
        return mask
    return op.Expand(mask, op.Constant(value=ir.tensor(np.array([rows, 1], dtype=np.int64))))


def _broadcasts(dims: list[int | None] | None, target: list[int | None]) -> bool:
    """``dims`` is statically known to broadcast to ``target`` (right-aligned, rank <= 4)."""
    if dims is None or len(dims) > len(target):
        return False
    return all(d == 1 or (d is not None and d == t) for d, t in zip(reversed(dims), reversed(target), strict=False))


def _is_causal(masked: np.ndarray, kept: np.ndarray, values: np.ndarray | None, sq: int | None, skv: int | None) -> bool:
    """A constant mask that is exactly the causal triangle (query ``i`` sees keys ``<= i``),
    the same for every batch row and head; kept entries of a float mask must be 0."""
    if sq is None or sq != skv or masked.shape[-2:] != (sq, skv):
        return False
    tril = np.tril(np.ones((sq, skv), dtype=bool))
    zeros = values is None or not np.any(values[kept])
    return bool(zeros and np.all(kept == tril) and np.all(masked == ~tril))


class _RepeatedKeyValues(pattern.RewriteRuleClassBase):
    """GQA: ``Attention`` reading K and V through ``repeat_kv`` (Unsqueeze at 2, Expand,
    Reshape) reads the shared heads directly."""

    def pattern(self, op, query, key, value, k_axes, v_axes):
        k = op.Reshape(op.Expand(op.Unsqueeze(key, k_axes), _ANY, _outputs=["k_wide"]), _ANY, _outputs=["k_rep"])
        v = op.Reshape(op.Expand(op.Unsqueeze(value, v_axes), _ANY, _outputs=["v_wide"]), _ANY, _outputs=["v_rep"])
        return op.Attention(query, k, v, pattern.Var("mask", can_match_none=True), _outputs=["out"],
                            _allow_other_inputs=False)

    def check(self, context, query, key, value, k_axes, v_axes, **kw):
        result = pattern.MatchResult()
        q = static_dims(query)
        for source, axes, wide, rep in ((key, k_axes, kw["k_wide"], kw["k_rep"]), (value, v_axes, kw["v_wide"], kw["v_rep"])):
            d, w, r = static_dims(source), static_dims(wide), static_dims(rep)
            axis = const_scalar(axes)
            if q is None or d is None or w is None or r is None or axis not in (2, -3) or len(d) != 4 or len(w) != 5:
                return result.fail("not repeat_kv: Unsqueeze at 2 of a 4-D value, Expand to 5-D", source)
            if None in d or None in r or r[0] != d[0] or r[2:] != d[2:] or r[1] != q[1] or r[1] % d[1]:
                return result.fail("repeat_kv's Reshape does not give [B, heads, S, D] from the shared heads", source)
            if any(x is not None and x != y for x, y in zip(w[:2] + w[3:], d, strict=True)):
                return result.fail("repeat_kv's Expand broadcasts more than the new axis", source)
        return result

    def rewrite(self, op, query, key, value, mask=None, out=None, **_):
        assert out is not None
        attrs = out.producer().attributes
        inputs = [query, key, value] + ([mask] if mask is not None else [])
        return op.Attention(*inputs, **{k: a.value for k, a in attrs.items()})


#: Rule 4 (commute: the scale and the mask in either operand), then rule 5's GQA.
ATTENTION_RULES = (pattern.RewriteRuleSet([_EagerAttention.rule()], commute=True),
                   pattern.RewriteRuleSet([_RepeatedKeyValues.rule()]))


def drop_known_masks(graph: ir.Graph) -> int:
    """Rule 5: an ``Attention`` whose constant mask hides nothing loses it, one whose mask is
    the causal triangle gets ``is_causal=1`` instead (as the eager forms do). Returns how many."""
    changed = 0
    for node in graph:
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 4:
            continue
        mask, q, k = node.inputs[3], static_dims(node.inputs[0]), static_dims(node.inputs[1])
        array = _known(mask) if q is not None and k is not None and len(q) == 4 else None
        if array is None or node.attributes.get_int("is_causal", 0):
            continue
        kept = array if array.dtype == np.bool_ else array > _MASKED
        values = None if array.dtype == np.bool_ else array
        if np.all(kept) and (values is None or not values.any()):
            causal = 0
        elif _is_causal(~kept, kept, values, q[2], k[2]):
            causal = 1
        else:
            continue
        node.resize_inputs(3)
        node.attributes["is_causal"] = ir.AttrInt64("is_causal", causal)
        changed += 1
    return changed


# -- rotary embedding -------------------------------------------------------------------------


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else [int(i) for i in tensor.numpy().reshape(-1)]


class _RotaryEmbedding(pattern.RewriteRuleClassBase):
    """HF's ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x[..., D/2:], x[...,
    :D/2])``, on a 4-D ``x`` ``[B, H, S, D]`` with caches known before the graph runs (the
    TorchScript export folds them from ``inv_freq`` and the positions): ``cos`` and ``sin``
    broadcast to ``[B, 1, S, D]``, each the same in both halves (HF's ``cat(freqs, freqs)``).
    Becomes ``RotaryEmbedding(x, cos[..., :D/2], sin[..., :D/2])``, the caches ``[B, S, D/2]``
    (a batch of 1 expanded to ``x``'s: ONNX Runtime wants the input's)."""

    def pattern(self, op, x, cos, sin, start1, end1, axes1, steps1, start2, end2, axes2, steps2):
        first, second = op.Slice(x, start1, end1, axes1, steps1), op.Slice(x, start2, end2, axes2, steps2)
        rotated = op.Concat(op.Neg(second), first, axis=pattern.AttrVar("concat_axis"))
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos, sin, start1, end1, axes1, steps1, start2, end2, axes2, steps2, concat_axis,
              **_):
        result = pattern.MatchResult()
        dims = static_dims(x)
        if dims is None or len(dims) != 4 or dims[3] is None or dims[3] % 2 or dims[2] is None:
            return result.fail("x is not 4-D [B, H, S, D] with S and an even D known", x)
        half = dims[3] // 2
        axis = getattr(concat_axis, "value", concat_axis)
        slices = [_ints(v) for v in (start1, end1, axes1, steps1, start2, end2, axes2, steps2)]
        if axis not in (3, -1) or any(v is None or len(v) != 1 for v in slices):
            return result.fail("rotate_half's Slices or Concat are not over the last axis with constants", x)
        (s1,), (e1,), (a1,), (t1,), (s2,), (e2,), (a2,), (t2,) = slices  # type: ignore[misc]
        if not (s1 == 0 and e1 == half and s2 == half and e2 >= dims[3] and a1 in (3, -1) and a2 in (3, -1)
                and t1 == t2 == 1):
            return result.fail("rotate_half does not split the last axis in halves", x)
        caches = []
        for cache in (cos, sin):
            array = _known(cache)
            if array is None or cache.dtype != x.dtype:
                return result.fail("the rotary cache is not known before the graph runs, or not x's type", cache)
            rows = _cache_rows(array, dims)
            if rows is None or not np.array_equal(rows[..., :half], rows[..., half:]):
                return result.fail("the rotary cache is not [B or 1, 1, S, D] with equal halves", cache)
            caches.append(rows[..., :half])
        self._caches = caches
        return result

    def rewrite(self, op, x, **_):
        cos, sin = (op.Constant(value=ir.tensor(np.ascontiguousarray(c))) for c in self._caches)
        if self._caches[0].shape[0] != static_dims(x)[0]:
            shape = op.Concat(op.Shape(x, start=0, end=1), op.Constant(value=ir.tensor(np.ones(2, np.int64))), axis=0)
            cos, sin = op.Expand(cos, shape), op.Expand(sin, shape)
        return op.RotaryEmbedding(x, cos, sin)


def _cache_rows(array: np.ndarray, dims: list[int | None]) -> np.ndarray | None:
    """A cache that broadcasts to ``[B, H, S, D]`` the same for every head, as ``[B or 1, S, D]``."""
    if not 2 <= array.ndim <= 4 or array.shape[-2:] != (dims[2], dims[3]):
        return None
    if array.ndim == 2:
        return array[None]
    if array.ndim == 3:
        return array if array.shape[0] == 1 else None
    return array[:, 0] if array.shape[1] == 1 and array.shape[0] in (1, dims[0]) else None


#: Rule 5's rotary (commute: the caches and the products in either operand).
ROTARY_RULES = pattern.RewriteRuleSet([_RotaryEmbedding.rule()], commute=True)
