"""CanonicalizeOpsPass: every exporter's attention, rotary, GELU and norms as the standard ONNX op.

torch's exporters write one layer many ways: eager attention as MatMul-scale-mask-Softmax-MatMul
(an additive float mask, a ``Where`` boolean mask, a folded causal triangle, GQA's ``repeat_kv``
as Unsqueeze-Expand-Reshape, Identity and no-op Casts in between), the torch SDPA decomposition
(``sqrt(scale)`` on Q and K, ``Where(IsNaN(p), 0, p)``), GELU as erf or tanh formulas, LayerNorm
and RMSNorm written out, HF's rotary embedding written out. The gradient rules and the fused
kernels are written once, for the standard ops ``Attention`` (opset 23), ``RotaryEmbedding``
(23), ``Gelu`` (20), ``LayerNormalization`` (17) and ``RMSNormalization`` (23); this pass
rewrites the other forms into them before differentiating, with onnxscript's pattern rewriter.
What it does not recognise it leaves, and logs.
"""

from __future__ import annotations

import logging
import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mpgraph._ir.names import NameScope
from mpgraph.io import min_ir_version
from mpgraph.targets import lost_kernels, tables
from mpgraph.training.canonical_attention import (
    ATTENTION_RULES,
    ROTARY_RULES,
    const_scalar,
    drop_known_masks,
    last_axis,
    static_dims,
)

__all__ = ["CANONICAL_OPS", "CanonicalizeOpsPass"]

logger = logging.getLogger(__name__)
#: The metadata key onnxscript's rewriter writes on each node its rules make.
_RULE_NAME_KEY = "pkg.onnxscript.rewriter.rule_name"

#: The standard op each rule family writes, and the opset that op needs.
CANONICAL_OPS = {"Attention": 23, "RotaryEmbedding": 23, "RMSNormalization": 23, "Gelu": 20, "LayerNormalization": 17}
#: Ops whose meaning (not only their types) changed between opsets 18 and 23: a graph holding
#: one is not re-declared at a higher opset (GroupNormalization-21 scales per channel,
#: GridSample-20 renamed its modes, DFT-20 takes its axis as an input).
_CHANGED_BY_23 = {"GroupNormalization": 21, "GridSample": 20, "DFT": 20}
#: The standard ops of rules 4 and 5, written only with ``attention``.
_ATTENTION_OPS = ("Attention", "RotaryEmbedding")
_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# -- GELU -------------------------------------------------------------------------------------


def _either(op, op_type: str, a, b):
    """``op_type(a, b)`` or ``op_type(b, a)`` (constants are second already: ``_constants_second``)."""
    return pattern.OrValue([getattr(op, op_type)(a, b), getattr(op, op_type)(b, a)])


def _gelu_forms(op, x, one_plus) -> list:
    """``0.5 * x * one_plus`` in the associations and operand orders exporters write."""
    half_x, half_one_plus = op.Mul(x, 0.5), op.Mul(one_plus, 0.5)
    return [op.Mul(half_x, one_plus), op.Mul(one_plus, half_x), op.Mul(x, half_one_plus),
            op.Mul(half_one_plus, x), op.Mul(_either(op, "Mul", x, one_plus), 0.5)]


#: How many final forms ``_gelu_forms`` gives (one rule each).
_GELU_FORMS = 5


class _ErfGelu(pattern.RewriteRuleClassBase):
    def __init__(self, form: int) -> None:
        super().__init__(f"ErfGelu{form}")
        self.form = form

    def pattern(self, op, x):
        scaled = pattern.OrValue([op.Div(x, _SQRT2), op.Mul(x, 1.0 / _SQRT2)])
        return _gelu_forms(op, x, op.Add(op.Erf(scaled), 1.0))[self.form]

    def rewrite(self, op, x):
        return op.Gelu(x)


class _TanhGelu(pattern.RewriteRuleClassBase):
    def __init__(self, form: int) -> None:
        super().__init__(f"TanhGelu{form}")
        self.form = form

    def pattern(self, op, x):
        cube = pattern.OrValue([op.Pow(x, 3.0), _either(op, "Mul", x, op.Mul(x, x))])
        inner = op.Mul(_either(op, "Add", x, op.Mul(cube, 0.044715)), _SQRT_2_OVER_PI)
        return _gelu_forms(op, x, op.Add(op.Tanh(inner), 1.0))[self.form]

    def rewrite(self, op, x):
        return op.Gelu(x, approximate="tanh")


# -- norms ------------------------------------------------------------------------------------


def _inverse_root(op, x):
    root = op.Sqrt(x)
    return root, pattern.OrValue([op.Reciprocal(root), op.Div(1.0, root)])


class _RmsNorm(pattern.RewriteRuleClassBase):
    """``scale * x / sqrt(mean(x^2) + eps)`` over the last axis."""

    def pattern(self, op, x, scale, axes, epsilon):
        mean_square = op.ReduceMean(op.Pow(x, 2.0), axes, keepdims=1)
        _, inverse = _inverse_root(op, op.Add(mean_square, epsilon))
        return op.Mul(op.Mul(x, inverse), scale)

    def check(self, context, x, scale, axes, epsilon, **_):
        return _norm_check(x, scale, axes, epsilon)

    def rewrite(self, op, x, scale, epsilon, **_):
        return op.RMSNormalization(x, scale, axis=-1, epsilon=const_scalar(epsilon), stash_type=1)


class _LayerNorm(pattern.RewriteRuleClassBase):
    """``scale * (x - mean) / sqrt(var + eps)`` over the last axis (the bias: ``_LayerNormBias``)."""

    def pattern(self, op, x, scale, axes, axes2, epsilon):
        deviation = op.Sub(x, op.ReduceMean(x, axes, keepdims=1))
        square = pattern.OrValue([op.Mul(deviation, deviation), op.Pow(deviation, 2.0)])
        root, inverse = _inverse_root(op, op.Add(op.ReduceMean(square, axes2, keepdims=1), epsilon))
        normalized = pattern.OrValue([op.Mul(deviation, inverse), op.Div(deviation, root)])
        return op.Mul(normalized, scale)

    def check(self, context, x, scale, axes, axes2, epsilon, **_):
        result = _norm_check(x, scale, axes, epsilon)
        return result if not result or last_axis(axes2, x) else result.fail("variance not over the last axis", x)

    def rewrite(self, op, x, scale, epsilon, **_):
        return op.LayerNormalization(x, scale, axis=-1, epsilon=const_scalar(epsilon), stash_type=1)


class _LayerNormBias(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, scale, bias):
        return op.Add(op.LayerNormalization(x, scale, _outputs=["normalized"]), bias)

    def check(self, context, x, scale, bias, normalized, **_):
        ok = static_dims(bias) is not None and static_dims(bias) == static_dims(scale) and bias.dtype == x.dtype
        result = pattern.MatchResult()
        return result if ok and len(normalized.producer().outputs) == 1 else result.fail("bias is not [D]", bias)

    def rewrite(self, op, x, scale, bias, normalized, **_):
        attrs = {k: a.value for k, a in normalized.producer().attributes.items()}
        return op.LayerNormalization(x, scale, bias, **attrs)


def _norm_check(x: ir.Value, scale: ir.Value, axes: ir.Value, epsilon: ir.Value) -> pattern.MatchResult:
    result = pattern.MatchResult()
    dims = static_dims(x)
    if x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or scale.dtype != x.dtype:
        return result.fail("a norm is canonicalised in float32 or float64 only", x)
    if not dims or dims[-1] is None or static_dims(scale) != [dims[-1]]:
        return result.fail("the scale is not [D], D the last axis", scale)
    if not last_axis(axes, x):
        return result.fail("the mean is not over the last axis", x)
    if const_scalar(epsilon) is None:
        return result.fail("epsilon is not a constant scalar", epsilon)
    return result


# -- the pass ---------------------------------------------------------------------------------

#: (standard op, rules, whether a rewrite adds one: LayerNorm's bias and GQA's repeat_kv
#: rewrite an op already written).
_RULE_SETS: tuple[tuple[str, pattern.RewriteRuleSet, bool], ...] = (
    ("LayerNormalization", pattern.RewriteRuleSet([_LayerNorm.rule()], commute=True), True),
    ("LayerNormalization", pattern.RewriteRuleSet([_LayerNormBias.rule()], commute=True), False),
    ("RMSNormalization", pattern.RewriteRuleSet([_RmsNorm.rule()], commute=True), True),
    ("Gelu", pattern.RewriteRuleSet([_ErfGelu.rule(form=f) for f in range(_GELU_FORMS)]
                                    + [_TanhGelu.rule(form=f) for f in range(_GELU_FORMS)]), True),
    ("RotaryEmbedding", ROTARY_RULES, True),
    ("Attention", ATTENTION_RULES[0], True),
    ("Attention", ATTENTION_RULES[1], False),
)


class CanonicalizeOpsPass(ir.passes.InPlacePass):
    """Rewrite attention, rotary embeddings, GELU and norms written out into the standard ONNX ops.

    With ``attention=False`` rules 4 and 5 do not run (and a Softmax left is not logged):
    ``build_training_graph`` canonicalises activations and norms by default, attention and
    rotary embeddings only when asked or for CUDA (their fused CUDA kernels are the lowering's;
    elsewhere ORT's own would run).

    Rules, in order:

    1. No-op nodes between the ops of a pattern go: ``Identity`` (torch's clone and dropout
       in eval) and a ``Cast`` to the type its input has (HF's ``softmax(..., dtype=float32)
       .to(query.dtype)`` in float32), unless they read a graph input or an initializer or
       write a graph output. A ``CastLike`` of a small constant becomes a ``Constant``, and a
       constant operand of ``Add``/``Mul`` is put second.
    2. ``scale * (x - mean) / sqrt(var + eps) (+ bias)`` over the last axis becomes
       ``LayerNormalization``; then ``scale * x / sqrt(mean(x^2) + eps)`` (``Reciprocal`` or
       ``1 /``) becomes ``RMSNormalization`` (LayerNorm first: its tail is an RMS of ``x - mean``).
    3. ``0.5 * x * (1 + erf(x / sqrt 2))`` becomes ``Gelu``, ``0.5 * x * (1 + tanh(sqrt(2/pi)
       (x + 0.044715 x^3)))`` ``Gelu(approximate="tanh")``, in each association and operand order.
    4. ``MatMul(softmax(s * Q K^T + mask), V)`` becomes ``Attention(Q, K, V[, mask], scale=s)``
       with 4-D inputs: K transposed directly, through 3-D, or from ``[B, S, H, D]``; ``s`` the
       product of constant factors on Q, on K^T and on the scores (``Mul`` or ``Div``); one or
       two masks added (float: T5 adds its position bias, then the causal mask), or a ``Where(mask, scores, -inf)`` / ``Where(mask, -inf, scores)``
       (boolean, masked_fill's read through a ``Not``); a mask known before the graph runs
       (constant, or computed from constants and static shapes) that hides nothing
       is dropped, the causal triangle becomes ``is_causal=1``. A mask that broadcasts over
       the query positions is expanded to them (ONNX Runtime refuses it). The attention rules
       live in ``canonical_attention``.
    5. ``Attention`` reading K and V through ``repeat_kv`` reads the shared heads (GQA); an
       ``Attention`` (the exporter's too) with a known mask that hides nothing drops it,
       one with the causal triangle gets ``is_causal=1`` instead. HF's rotary embedding
       written out, ``x * cos + cat(-x2, x1) * sin`` on a 4-D ``x`` whose halves are ``x1``
       and ``x2``, with caches known before the graph runs that are the same in both halves,
       becomes ``RotaryEmbedding(x, cos[..., :D/2], sin[..., :D/2])`` (TorchScript writes it
       so; the dynamo exporter writes ``RotaryEmbedding`` itself at opset 23).
    6. The opset is raised to what the new ops need (23 for Attention, RotaryEmbedding and
       RMSNormalization, 20 for Gelu) and the IR version with it, unless the graph holds an op
       whose meaning changed on the way (``_CHANGED_BY_23``): then the rules whose op needs it
       are skipped, and logged.
       With ``provider``, a rule whose op needs an opset at which an op of the graph has no
       kernel on that ORT provider that it has now (``targets.lost_kernels``: on ORT 1.31.1
       CUDA, Dropout, Elu, MaxPool and Selu at opset 22 and up) is skipped too: its forms stay
       written out, and one line says how many and why (they are then not logged as
       unrecognised).
    7. Softmax, Erf, Tanh-of-cube, ReduceMean and rotate_half's Neg nodes left over are logged
       as not recognised.

    ``counts`` holds, after a call, how many of each standard op the rules wrote.

    Example:
        >>> from onnx import helper as h, TensorProto
        >>> nodes = [h.make_node("Div", ["x", "r2"], ["d"]), h.make_node("Erf", ["d"], ["e"]),
        ...          h.make_node("Add", ["one", "e"], ["a"]), h.make_node("Mul", ["x", "a"], ["m"]),
        ...          h.make_node("Mul", ["m", "half"], ["y"])]
        >>> consts = [h.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in (("r2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
        >>> graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        ...                      [h.make_tensor_value_info("y", TensorProto.FLOAT, [3])], initializer=consts)
        >>> model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]))
        >>> canonicalize = CanonicalizeOpsPass()
        >>> canonicalize(model).modified, [n.op_type for n in model.graph], model.opset_imports[""]
        (True, ['Gelu'], 20)
        >>> canonicalize(model).modified
        False
    """

    def __init__(self, attention: bool = True, provider: str | None = None) -> None:
        """``provider``: the ORT provider (``cuda``, ``cpu``) whose kernels an opset raise
        must not take from the graph's ops (rule 6); ``None``: no check."""
        super().__init__()
        self.attention = attention
        self.provider = provider
        self.counts: dict[str, int] = {}
        #: After a call: how many forms of each standard op were kept written out (rule 6).
        self.kept: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1))
        ceiling = _opset_ceiling(graph, opset)
        self.counts, self.kept = dict.fromkeys(CANONICAL_OPS, 0), {}
        modified = _drop_noop_nodes(graph) > 0
        modified = _fold_cast_like(graph) > 0 or modified
        modified = _constants_second(graph) > 0 or modified
        lost = _lost_kernels(graph, opset, ceiling, self.provider)
        wanted = [t for t, _, _ in _RULE_SETS if (self.attention or t not in _ATTENTION_OPS) and CANONICAL_OPS[t] <= ceiling
                  and CANONICAL_OPS[t] not in lost]
        # the rewriter builds nodes against the graph's opset
        graph.opset_imports[""] = max([opset] + [CANONICAL_OPS[t] for t in wanted])
        for op_type, rules, adds in _RULE_SETS:
            if op_type in _ATTENTION_OPS and not self.attention:
                continue
            if CANONICAL_OPS[op_type] > ceiling:
                logger.info("%s forms are left as they are: the graph cannot be raised to opset %d",
                            op_type, CANONICAL_OPS[op_type])
                continue
            if CANONICAL_OPS[op_type] in lost:
                self._keep(model, op_type, rules, opset, lost[CANONICAL_OPS[op_type]])
                continue
            found = rules.apply_to_model(model)
            modified = modified or found > 0
            if adds:
                self.counts[op_type] += found
        if self.attention:
            modified = drop_known_masks(graph) > 0 or modified
        needed = max([opset] + [CANONICAL_OPS[t] for t, n in self.counts.items() if n])
        graph.opset_imports[""] = needed
        modified = modified or needed != opset or any(self.counts.values())
        if modified:
            model.ir_version = max(model.ir_version, min_ir_version(graph.opset_imports))
            _drop_dead_nodes(graph)
            _name_new(graph)
            for node in graph:  # onnxscript's rewriter tags the nodes it makes with the rule's name
                node.metadata_props.pop(_RULE_NAME_KEY, None)
        _log_leftovers(graph, self.attention, self.kept)
        logger.info("canonical ops written: %s", {k: v for k, v in self.counts.items() if v})
        return ir.passes.PassResult(model, modified)

    def _keep(self, model: ir.Model, op_type: str, rules: pattern.RewriteRuleSet, opset: int,
              lost: dict[str, list[str]]) -> None:
        """Rule 6: count the forms ``rules`` would rewrite (nothing changes) and say why they stay."""
        graph = model.graph
        kept = sum(1 for node in list(graph) if any(rule.try_rewrite(model, graph, node) for rule in rules.rules))
        self.kept[op_type] = kept
        if kept:
            table = tables()[self.provider]
            ops = "; ".join(f"{op} ({', '.join(dtypes)})" for op, dtypes in lost.items())
            logger.warning(
                "canonical ops: %d %s form(s) kept written out: they need opset %d, and ORT %s %s (%s) runs "
                "%s at opset %d but not at %d; canonicalize=True (train-graph --canonical-ops) rewrites them anyway",
                kept, op_type, CANONICAL_OPS[op_type], self.provider, table["onnxruntime"], table["probe"], ops,
                opset, CANONICAL_OPS[op_type])


def _opset_ceiling(graph: ir.Graph, opset: int) -> int:
    """23, or the current opset when an op in the graph changed meaning on the way."""
    changed = sorted({n.op_type for n in graph if n.domain in ("", "ai.onnx")
                      and opset < _CHANGED_BY_23.get(n.op_type, 0) <= 23})
    if changed and opset < 23:
        logger.warning("opset %d is not raised to 23: %s changed meaning since (canonical ops that need it are skipped)",
                       opset, ", ".join(changed))
        return opset
    return max(opset, 23)


def _lost_kernels(graph: ir.Graph, opset: int, ceiling: int, provider: str | None) -> dict[int, dict[str, list[str]]]:
    """Rule 6: for each opset a standard op needs (above the graph's, up to ``ceiling``), the
    ops of the graph that would lose a kernel on ``provider`` there (only opsets where some do)."""
    if provider is None:
        return {}
    ops = {n.op_type for n in graph if n.domain in ("", "ai.onnx")}
    lost = {needed: lost_kernels(provider, ops, opset, needed) for needed in set(CANONICAL_OPS.values())
            if opset < needed <= ceiling}
    return {needed: found for needed, found in lost.items() if found}


def _drop_noop_nodes(graph: ir.Graph) -> int:
    """Rule 1; returns how many nodes went."""
    dropped = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Identity", "Cast") or len(node.inputs) != 1:
            continue
        source, out = node.inputs[0], node.outputs[0]
        if source is None or source.is_graph_input() or source.is_initializer() or out.is_graph_output():
            continue
        if node.op_type == "Cast" and (source.dtype is None or node.attributes.get_int("to") != source.dtype.value):
            continue
        out.replace_all_uses_with(source)
        graph.remove(node, safe=True)
        dropped += 1
    return dropped


def _fold_cast_like(graph: ir.Graph) -> int:
    """A ``CastLike`` of a constant becomes the constant in the other operand's type: the
    dynamo exporter's ``CastLike(-inf, scores)`` is a second use of the scores, which would
    keep the matched attention nodes alive. Returns how many were folded."""
    names = NameScope(graph)
    folded = 0
    for node in list(graph):
        if node.op_type != "CastLike" or node.domain not in ("", "ai.onnx") or node.outputs[0].is_graph_output():
            continue
        tensor = ir.convenience.get_const_tensor(node.inputs[0]) if node.inputs[0] is not None else None
        like = node.inputs[1]
        if tensor is None or like is None or like.dtype is None or tensor.numpy().size > 16:
            continue
        array = tensor.numpy().astype(like.dtype.numpy())
        constant = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array))], name=names.fresh(f"{node.name}/folded"))
        graph.insert_before(node, constant)
        out = node.outputs[0]
        constant.outputs[0].name, out.name = out.name, None
        constant.outputs[0].dtype, constant.outputs[0].shape = like.dtype, ir.Shape(array.shape)
        out.replace_all_uses_with(constant.outputs[0])
        graph.remove(node, safe=True)
        folded += 1
    return folded


def _constants_second(graph: ir.Graph) -> int:
    """A constant operand of ``Add`` or ``Mul`` is put second (exact: both commute), so the
    GELU rules need not try every operand order. Returns how many nodes were swapped."""
    swapped = 0
    for node in graph:
        if (node.op_type in ("Add", "Mul") and node.domain in ("", "ai.onnx") and len(node.inputs) == 2
                and const_scalar(node.inputs[0]) is not None and const_scalar(node.inputs[1]) is None):
            a, b = node.inputs
            node.replace_input_with(0, b)
            node.replace_input_with(1, a)
            swapped += 1
    return swapped


def _drop_dead_nodes(graph: ir.Graph) -> None:
    """Nodes whose outputs nothing reads any more (the constant ``sqrt(scale)`` factors of
    torch's SDPA decomposition once its Muls are gone) go."""
    for node in reversed(list(graph)):
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)


def _name_new(graph: ir.Graph) -> None:
    """Names for the nodes and values the rewriter made (``canonical/<op>``)."""
    names = NameScope(graph)
    for node in graph:
        if not node.name:
            node.name = names.fresh(f"canonical/{node.op_type}")
        for k, out in enumerate(node.outputs):
            if not out.name:
                out.name = names.fresh(f"{node.name}/output_{k}")


def _log_leftovers(graph: ir.Graph, attention: bool, kept: dict[str, int]) -> None:
    """Rule 7: the forms that look like attention, GELU or a norm and were not rewritten (less
    those rule 6 kept on purpose: an RMSNorm form has one ReduceMean)."""
    left: dict[str, list[str]] = {}
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Softmax" and attention:
            left.setdefault("attention (Softmax)", []).append(node.name or "?")
        elif node.op_type == "Neg" and attention and _rotates_half(node):
            left.setdefault("rotary embedding (Neg of a Slice, into a Concat)", []).append(node.name or "?")
        elif node.op_type == "Erf":
            left.setdefault("erf GELU (Erf)", []).append(node.name or "?")
        elif node.op_type == "Tanh" and _reads_cube(node):
            left.setdefault("tanh GELU (Tanh)", []).append(node.name or "?")
        elif (node.op_type == "ReduceMean" and node.attributes.get_int("keepdims", 1) and len(node.inputs) > 1
              and node.inputs[0] is not None and last_axis(node.inputs[1], node.inputs[0])):
            left.setdefault("a norm (ReduceMean)", []).append(node.name or "?")
    norms = left.get("a norm (ReduceMean)", [])
    if norms and kept.get("RMSNormalization"):
        del norms[:kept["RMSNormalization"]]
    for form, nodes in left.items():
        if not nodes:
            continue
        logger.warning("canonical ops: %d %s left as written, not recognised (first: node '%s')", len(nodes), form, nodes[0])


def _rotates_half(node: ir.Node) -> bool:
    """Whether a Neg reads a Slice and feeds a Concat (HF's ``rotate_half``)."""
    source = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    return source is not None and source.op_type == "Slice" and any(
        use.node.op_type == "Concat" for use in node.outputs[0].uses())


def _reads_cube(node: ir.Node, depth: int = 0) -> bool:
    """Whether a Pow(x, 3) feeds ``node`` within a few steps (the tanh GELU's inner term)."""
    if depth > 4:
        return False
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is None:
            continue
        if producer.op_type == "Pow" and const_scalar(producer.inputs[1]) == 3.0 or (
                producer.op_type == "Mul" and any(v is not None and v.producer() is not None
                                                  and v.producer().op_type == "Mul" for v in producer.inputs)):
            return True
        if _reads_cube(producer, depth + 1):
            return True
    return False
