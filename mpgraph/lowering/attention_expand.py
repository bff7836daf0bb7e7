"""Write an ``Attention`` the ``sdpa`` rule did not fuse as standard ops (a CUDA session lowering).

ONNX Runtime 1.31.1's CUDA provider has no ``Attention`` kernel for many configurations: the
Llama dynamo export's 12 Attention nodes were placed on the CPU provider, and a step with a
node off CUDA cannot be captured as a CUDA graph. The ``sdpa`` rule fuses the Attention nodes
cuDNN computes (float16/bfloat16, head dim a multiple of 8 up to 128, no mask, no softcap, a
library with cuDNN); this rule, right after it, writes every other one as the ops of ONNX's
function body for Attention (opset 23), which the CUDA provider runs::

    Q [B, Hq, Sq, D] (3-D: Reshape [0, 0, Hq, -1], Transpose [0, 2, 1, 3])
    K [B, Hkv, Skv, D], V [B, Hkv, Skv, Dv] (likewise)
    S = MatMul(Reshape(Q * r, [0, Hkv, -1, 0]), Transpose(K * r))  -> Reshape [0, Hq, -1, 0]
    S = Mul(Tanh(Div(S, softcap)), softcap)                           (softcap > 0)
    P = Softmax(Add(S, bias))                                        (softmax_precision: Casts around)
    P = Where(IsInf(ReduceMax(bias, -1)), 0, P)                      (a mask: a fully masked row is 0)
    Y = MatMul(Reshape(P, [0, Hkv, -1, 0]), V) -> Reshape [0, Hq, -1, 0] (3-D: Transpose, Reshape)

with ``r = sqrt(scale)`` computed in float32 and rounded to the node's dtype, as the body's
``ScaleFactorF`` (``scale`` defaults to ``1 / sqrt(head_size)`` in float32), GQA query head
``g * reps + i`` reading kv head ``g`` through the reshape of Q (the gradient rule's
``_grouping``; the body expands K and V instead: the same dot products), and ``bias`` the
body's: a causal upper triangle of ``-inf`` (a shared constant where Sq and Skv are static,
``ConstantOfShape`` and ``Trilu`` otherwise) plus the mask (boolean: 0 / ``-inf``; float: as
is). With a mask the bias is made in float32, as the body makes it, and rounded to the node's
dtype once (ORT CUDA has no bfloat16 ``ReduceMax`` for the row guard); without one it is made
in the node's dtype.

Everything else computes in the node's dtype, the body's order of operations: a bfloat16
Attention gets bfloat16 scores and a bfloat16-in, bfloat16-out Softmax, which ORT CUDA computes
in float32 inside. That is what the bf16/fp16 policies decide for the exporter's own written-out
attention (``AssignPrecisionPass`` phase 7, a Softmax between low ops takes low I/O), and what
the gradient rule's recomputed probabilities in the same step run in. Float32 scores would add
two Casts of the ``[B, H, Sq, Skv]`` tensor and double the bytes the Add and the Softmax move
(arithmetic, not measured), for the same values where the bias is 0 or ``-inf`` (causal,
boolean masks: the MatMul rounds the scores to bfloat16 either way, and those adds are exact);
a float mask's sum and a softcap's Tanh round to bfloat16 once more here. The guard is left out without a mask
(causal alone leaves every query its first key: the body's Where picks P everywhere). The
values are the body's ops in its order; ORT's own Attention kernel and the MatMuls sum in their
own orders, so against the node it replaces the rule is ``same math``.

The node's backward block is not touched: the gradient rule recomputes the probabilities with
standard ops already. Left alone, logged: a KV cache (inputs 4-6), an extra output that is read,
a mask shorter than the keys, unknown ranks, head counts or head dims.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import hand_over, initializer

__all__ = ["expand_attention"]

logger = logging.getLogger(__name__)

#: Metadata of the Attention node its forward ops stand for (role, precision, reason); the
#: gradient links stay off them: no single op of the expansion has the node's gradients.
_LINKS = (md.NODE_GRAD_INPUTS, md.NODE_GRAD_OUTPUTS)
_LOW = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)


@dataclass(frozen=True)
class _Form:
    """What the expansion needs of one Attention node."""

    node: ir.Node
    rank: int
    hq: int
    hkv: int
    head_dim: int
    dtype: ir.DataType


def _form(node: ir.Node) -> _Form | str:
    """The node's form, or why it is left alone."""
    if len(node.inputs) < 3 or any(v is not None for v in node.inputs[4:]):
        return "a KV cache (past_key, past_value or nonpad_kv_seqlen)"
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return "an extra output (present_key, present_value or qk_matmul_output) is read"
    q, k, v = node.inputs[:3]
    if any(t is None or t.shape is None or t.dtype is None for t in (q, k, v)):
        return "Q, K or V has no known shape or dtype"
    if len({q.dtype, k.dtype, v.dtype}) != 1:  # type: ignore[union-attr]
        return "V's dtype is not Q's (the op allows two)"
    rank = len(q.shape)  # type: ignore[union-attr,arg-type]
    if rank not in (3, 4) or len(k.shape) != rank or len(v.shape) != rank:  # type: ignore[union-attr,arg-type]
        return "Q, K and V are not all 3-D or all 4-D"
    if rank == 3:
        hq, hkv = node.attributes.get_int("q_num_heads"), node.attributes.get_int("kv_num_heads")
    else:
        hq, hkv = q.shape[1], k.shape[1]  # type: ignore[union-attr,index]
    last = q.shape[-1]  # type: ignore[union-attr,index]
    if not isinstance(hq, int) or not isinstance(hkv, int) or not hq or not hkv or hq % hkv:
        return "the head counts are not static, or q heads are not a multiple of kv heads"
    if not isinstance(last, int) or last % (hq if rank == 3 else 1):
        return "Q's head dim is not static"
    mask, keys = node.inputs[3] if len(node.inputs) > 3 else None, k.shape[-2]  # type: ignore[union-attr,index]
    if mask is not None and mask.shape is not None and len(mask.shape) \
            and isinstance(mask.shape[-1], int) and isinstance(keys, int) and mask.shape[-1] != keys:
        return "a mask shorter than the keys (padded by the op)"
    return _Form(node, rank, hq, hkv, last // hq if rank == 3 else last, q.dtype)  # type: ignore[union-attr,arg-type]


def _root(node: ir.Node, head_dim: int) -> np.float32:
    """The body's ``ScaleFactorSqrt``: ``sqrt(scale)`` in float32, ``scale`` the attribute or
    ``1 / sqrt(head_size)`` computed in float32."""
    scale = node.attributes.get_float("scale")
    value = np.float32(1) / np.sqrt(np.float32(head_dim)) if scale is None else np.float32(scale)
    return np.sqrt(np.float32(value))


class _Expansion:
    """The ops of one node's expansion: typed outputs, the node's metadata on compute ops."""

    def __init__(self, graph: ir.Graph, form: _Form, names: NameScope) -> None:
        self.graph, self.form = graph, form
        self.rw = Rewrite(graph, form.node.name or "Attention", names=names)
        self.meta = {k: v for k, v in form.node.metadata_props.items() if k not in _LINKS}

    def op(self, op_type: str, *inputs: ir.Value | None, dtype: ir.DataType, shape: list | None,
           compute: bool = True, **attrs: object) -> ir.Value:
        node = self.rw.node(op_type, *inputs, name=op_type, **attrs)
        out = node.outputs[0]
        out.dtype = dtype
        out.shape = ir.Shape(shape) if shape is not None else None
        if compute:
            node.metadata_props.update(self._meta(node))
        return out

    def _meta(self, node: ir.Node) -> dict[str, str]:
        """The Attention's metadata, with the precision this op computes in where the
        Attention records one (a Cast: none) and, where that differs, the reason."""
        recorded = self.meta.get(md.NODE_PRECISION)
        if recorded is None:
            return self.meta
        floats = [v.dtype for v in (*node.outputs, *node.inputs) if v is not None and v.dtype in md.PRECISION_OF_DTYPE]
        own = md.Precision.NONE if node.op_type == "Cast" else md.PRECISION_OF_DTYPE[floats[0]] if floats else recorded
        if own == recorded:
            return self.meta
        meta = {k: v for k, v in self.meta.items() if k != md.NODE_PHASE}
        meta[md.NODE_PRECISION] = own
        meta[md.NODE_REASON] = (f"Attention '{self.form.node.name}' written out by attention_expand: this op computes "
                                f"in {own} (the function body's float32 bias and row guard, softmax_precision, a Cast)")
        return meta

    def ints(self, name: str, values: list[int]) -> ir.Value:
        return self.rw.constant(name, np.array(values, np.int64))

    def scalar(self, name: str, value: np.float32, dtype: ir.DataType) -> ir.Value:
        return self.rw.constant(name, np.asarray(value, np.float32).astype(dtype.numpy()))

    def reshape(self, x: ir.Value, dims: list[int], shape: list | None) -> ir.Value:
        return self.op("Reshape", x, self.ints("shape", dims), dtype=x.dtype, shape=shape, compute=False)  # type: ignore[arg-type]

    def transpose(self, x: ir.Value, perm: list[int]) -> ir.Value:
        shape = None if x.shape is None else [x.shape[p] for p in perm]
        return self.op("Transpose", x, dtype=x.dtype, shape=shape, compute=False, perm=perm)  # type: ignore[arg-type]


def _dims(value: ir.Value, rank: int, heads: int) -> tuple:
    """``(B, H, S, D)`` of a Q/K/V input, ``None`` for an unknown dim."""
    shape = [d if isinstance(d, int) else None for d in value.shape]  # type: ignore[union-attr]
    if rank == 4:
        return tuple(shape)
    return shape[0], heads, shape[1], None if shape[2] is None else shape[2] // heads


def _split(x: _Expansion, value: ir.Value, heads: int) -> ir.Value:
    """``[B, S, H * D] -> [B, H, S, D]``; 4-D inputs are so already."""
    if x.form.rank == 4:
        return value
    b, h, s, d = _dims(value, 3, heads)
    return x.transpose(x.reshape(value, [0, 0, heads, -1], [b, s, h, d]), [0, 2, 1, 3])


def _causal(x: _Expansion, q4: ir.Value, k4: ir.Value, dtype: ir.DataType) -> ir.Value:
    """The ``[Sq, Skv]`` bias of ``-inf`` where key ``j > query i`` (no cache: offset 0)."""
    sq, skv = q4.shape[2], k4.shape[2]  # type: ignore[index]
    if isinstance(sq, int) and isinstance(skv, int):
        name = f"attention_expand/causal_{sq}x{skv}_{dtype.name.lower()}"
        found = x.graph.initializers.get(name)
        if found is not None:
            return found
        array = np.triu(np.full((sq, skv), -np.inf, np.float32), 1).astype(dtype.numpy())
        return initializer(x.graph, name, array)
    size = x.op("Concat", x.op("Shape", q4, dtype=ir.DataType.INT64, shape=[1], compute=False, start=2, end=3),
                x.op("Shape", k4, dtype=ir.DataType.INT64, shape=[1], compute=False, start=2, end=3),
                dtype=ir.DataType.INT64, shape=[2], compute=False, axis=0)
    fill = ir.tensor(np.array([-np.inf], np.float32))
    full = x.op("ConstantOfShape", size, dtype=ir.DataType.FLOAT, shape=[sq, skv], value=fill)
    tri = x.op("Trilu", full, x.rw.constant("diagonal", np.array(1, np.int64)), dtype=ir.DataType.FLOAT,
               shape=[sq, skv], upper=1)
    return tri if dtype == ir.DataType.FLOAT else x.op("Cast", tri, dtype=dtype, shape=[sq, skv], to=dtype.value)


def _bias(x: _Expansion, q4: ir.Value, k4: ir.Value) -> tuple[ir.Value | None, ir.Value | None]:
    """The bias in the node's dtype and, with a mask, its float32 form (float64 for a float64
    node) for the row guard."""
    node, dtype = x.form.node, x.form.dtype
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    causal = bool(node.attributes.get_int("is_causal", 0))
    if mask is None:
        return (_causal(x, q4, k4, dtype) if causal else None), None
    wide = ir.DataType.FLOAT if dtype in _LOW else dtype
    shape = list(mask.shape) if mask.shape is not None else None
    if mask.dtype == ir.DataType.BOOL:
        zero, neg = x.scalar("zero", np.float32(0), wide), x.scalar("neg_inf", np.float32(-np.inf), wide)
        bias = x.op("Where", mask, zero, neg, dtype=wide, shape=shape)
    else:
        bias = mask if mask.dtype == wide else x.op("Cast", mask, dtype=wide, shape=shape, to=wide.value)
    if causal:
        bias = x.op("Add", bias, _causal(x, q4, k4, wide), dtype=wide, shape=None)
    if dtype == wide:
        return bias, bias
    shape = list(bias.shape) if bias.shape is not None else None
    return x.op("Cast", bias, dtype=dtype, shape=shape, to=dtype.value), bias


def _probabilities(x: _Expansion, s: ir.Value, bias: ir.Value | None, bias32: ir.Value | None) -> ir.Value:
    """``softmax(s + bias)`` in ``softmax_precision`` (Casts around it where that is another
    dtype), a fully masked row 0."""
    shape = list(s.shape)  # type: ignore[arg-type]
    logits = s if bias is None else x.op("Add", s, bias, dtype=s.dtype, shape=shape)  # type: ignore[arg-type]
    precision = x.form.node.attributes.get_int("softmax_precision")
    wide = ir.DataType(precision) if precision is not None and ir.DataType(precision) != s.dtype else None
    if wide is not None:
        logits = x.op("Cast", logits, dtype=wide, shape=shape, to=wide.value)
    p = x.op("Softmax", logits, dtype=logits.dtype, shape=shape, axis=-1)  # type: ignore[arg-type]
    if wide is not None:
        p = x.op("Cast", p, dtype=s.dtype, shape=shape, to=s.dtype.value)  # type: ignore[arg-type,union-attr]
    if bias32 is None:  # causal alone leaves every query its own key
        return p
    top = x.op("ReduceMax", bias32, x.ints("axes", [-1]), dtype=bias32.dtype, shape=None, keepdims=1)  # type: ignore[arg-type]
    empty = x.op("IsInf", top, dtype=ir.DataType.BOOL, shape=None, detect_positive=0)
    return x.op("Where", empty, x.scalar("zero_p", np.float32(0), s.dtype), p, dtype=s.dtype, shape=shape)  # type: ignore[arg-type]


def _expand(graph: ir.Graph, form: _Form, names: NameScope) -> None:
    """Put the expansion in ``form.node``'s place; it takes over ``Y``."""
    x, node, dtype = _Expansion(graph, form, names), form.node, form.dtype
    q, k, v = node.inputs[:3]
    b, hq, sq, _ = _dims(q, form.rank, form.hq)  # type: ignore[arg-type]
    _, hkv, skv, dv = _dims(v, form.rank, form.hkv)  # type: ignore[arg-type]
    q4, k4, v4 = _split(x, q, form.hq), _split(x, k, form.hkv), _split(x, v, form.hkv)  # type: ignore[arg-type]
    root = x.scalar("scale_sqrt", _root(node, form.head_dim), dtype)
    qs = x.op("Mul", q4, root, dtype=dtype, shape=list(q4.shape))  # type: ignore[arg-type]
    ks = x.op("Mul", k4, root, dtype=dtype, shape=list(k4.shape))  # type: ignore[arg-type]
    reps = form.hq // form.hkv
    rows = None if sq is None else reps * sq

    def group(t: ir.Value, cols: int | None) -> ir.Value:
        return t if reps == 1 else x.reshape(t, [0, hkv, -1, 0], [b, hkv, rows, cols])

    def ungroup(t: ir.Value, cols: int | None) -> ir.Value:
        return t if reps == 1 else x.reshape(t, [0, hq, -1, 0], [b, hq, sq, cols])

    kt = x.transpose(ks, [0, 1, 3, 2])
    s = ungroup(x.op("MatMul", group(qs, form.head_dim), kt, dtype=dtype, shape=[b, hkv, rows, skv]), skv)
    softcap = node.attributes.get_float("softcap", 0.0)
    if softcap > 0:
        cap, scores = x.scalar("softcap", np.float32(softcap), dtype), [b, hq, sq, skv]
        tanh = x.op("Tanh", x.op("Div", s, cap, dtype=dtype, shape=scores), dtype=dtype, shape=scores)
        s = x.op("Mul", tanh, cap, dtype=dtype, shape=scores)
    p = _probabilities(x, s, *_bias(x, q4, k4))
    y = ungroup(x.op("MatMul", group(p, skv), v4, dtype=dtype, shape=[b, hkv, rows, dv]), dv)
    if form.rank == 3:
        y = x.reshape(x.transpose(y, [0, 2, 1, 3]), [0, 0, -1], None)
    for new in x.rw.nodes:
        graph.insert_before(node, new)
    hand_over([node.outputs[0]], [y])
    graph.remove(node, safe=True)


def expand_attention(model: ir.Model) -> int:
    """Write every ``Attention`` of ``model``'s main graph as its function body's standard ops
    (see the module), in place; how many were expanded. Those left alone are logged."""
    graph = model.graph
    found = [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    names = NameScope(graph)
    expanded = 0
    for node in found:
        form = _form(node)
        if isinstance(form, str):
            logger.warning("attention_expand: Attention '%s' left alone: %s", node.name, form)
            continue
        _expand(graph, form, names)
        expanded += 1
    if expanded:
        logger.info("attention_expand: %d Attention nodes written as standard ops", expanded)
    return expanded
