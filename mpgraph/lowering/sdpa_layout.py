"""Fused attention reads and writes the exporter's ``[B, S, H * D]`` tensors (a session lowering).

Exporters write multi-head attention around ``[B, H, S, D]`` tensors: each of Q, K and V is a
projection ``[B, S, H * D]`` reshaped to ``[B, S, H, D]`` and transposed, and the output is
transposed back and reshaped to ``[B, S, H * D]``; autodiff mirrors each of these in the
backward. After ``sdpa`` that leaves eight ``Transpose`` copies per layer around
``SdpaForward``/``SdpaBackward`` (GPT-2 small, batch 8, T 1024: 96 copies of 12.6 MB per step).
The fused kernels address their tensors through strides (``csrc/sdpa.h``) and read the 3-D
layout as it is (ONNX ``Attention``'s 3-D form, ``q_num_heads``/``kv_num_heads``), so::

    Y4, St = SdpaForward(T(R(q)), T(R(k)), T(R(v)))        Y, St = SdpaForward(q, k, v)
    y = R(T(Y4))                                        ->
    dq4, dk4, dv4 = SdpaBackward(..., Y4, T(R(dy)), St)     dq, dk, dv = SdpaBackward(q, k, v, Y, dy, St)
    dq = R(T(dq4)); dk = ...; dv = ...

with ``T`` the ``Transpose(perm=[0, 2, 1, 3])`` and ``R`` a ``Reshape`` between ``[B, S, H * D]``
and ``[B, S, H, D]``. The dynamo exporter's GPT-2 writes the output's and its gradient's flat
side 2-D, ``[B * S, H * D]`` (Conv1D's ``addmm``): a ``Reshape`` to ``[B, S, H * D]``, which ORT
runs as an alias of its input, stands between (without it the 12-layer step kept 96 Transposes,
0.69 ms on the H200, that the TorchScript export did not). A ``RotaryEmbedding`` between a transpose and the attention (Llama's Q
and K, and their gradients after it) runs on the 3-D tensor instead, in its ``num_heads`` form.
The pair is rewritten together or not at all (a forward without a
backward, in an evaluation graph, alone): every one of its 4-D tensors must come from, or go
only to, such a chain. The kernels compute the same sums in the same order on either layout:
bit-identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import (
    DOMAIN,
    hand_over,
    is_op,
    perm,
    producer,
    readers,
    remove_dead,
    single_reader,
)

__all__ = ["read_heads_in_place"]

logger = logging.getLogger(__name__)

_SWAP = [0, 2, 1, 3]


def _dims(value: ir.Value | None, rank: int) -> list | None:
    shape = value.shape if value is not None else None
    return list(shape) if shape is not None and len(shape) == rank else None


def _heads_of(flat: ir.Value, split: ir.Value) -> bool:
    """``split`` ``[B, S, H, D]`` is ``flat`` ``[B, S, H * D]`` with its last axis cut into heads,
    or ``flat`` ``[B * S, H * D]`` (the dynamo exporter's 2-D ``addmm`` operands and results) with
    B and S known: the same elements in the same order either way."""
    s = _dims(split, 4)
    if s is None or not all(isinstance(d, int) for d in (s[2], s[3])):
        return False
    f = _dims(flat, 3)
    if f is not None:
        return isinstance(f[2], int) and f[:2] == s[:2] and f[2] == s[2] * s[3]
    f = _dims(flat, 2)
    return (f is not None and isinstance(s[0], int) and isinstance(s[1], int)
            and f == [s[0] * s[1], s[2] * s[3]])


@dataclass
class _End:
    """One 4-D tensor of the pair as a ``[B, S, H * D]`` one: ``flat``, through a
    ``RotaryEmbedding`` (``rotary``, 4-D) between it and the attention op, or not. ``bsd``:
    ``[B, S, H * D]`` where ``flat`` is 2-D ``[B * S, H * D]`` (a Reshape, ORT's alias of its
    input, makes the kernels' 3-D view), else ``None``."""

    flat: ir.Value
    rotary: ir.Node | None = None
    bsd: list[int] | None = None


def _bsd(flat: ir.Value, split: ir.Value) -> list[int] | None:
    if _dims(flat, 2) is None:
        return None
    b, s, h, d = _dims(split, 4)  # type: ignore[misc]
    return [b, s, h * d]


def _rotary(node: ir.Node | None) -> bool:
    return is_op(node, "RotaryEmbedding") and len(node.inputs) >= 3 and all(v is not None for v in node.inputs[1:3])  # type: ignore[union-attr]


def _source(value: ir.Value | None, chain: set[ir.Node], pair: set[ir.Node]) -> _End | None:
    """``value`` ``[B, H, S, D]`` as the ``[B, S, H * D]`` tensor it was transposed from, maybe
    then rotated (a ``RotaryEmbedding`` read by the pair only), or ``None``."""
    rotary = value.producer() if value is not None else None
    if _rotary(rotary) and all(node in pair for node, _ in value.uses()) and not value.is_graph_output():  # type: ignore[union-attr]
        value = rotary.inputs[0]  # type: ignore[union-attr]
    else:
        rotary = None
    swap = producer(value, "Transpose")
    reshape = producer(swap.inputs[0], "Reshape") if swap is not None else None
    if reshape is None or perm(swap) != _SWAP or reshape.inputs[0] is None:
        return None
    flat = reshape.inputs[0]
    if not _heads_of(flat, reshape.outputs[0]):
        return None
    chain.update(n for n in (swap, reshape, rotary) if n is not None)
    return _End(flat, rotary, _bsd(flat, reshape.outputs[0]))


def _sink(value: ir.Value, chain: set[ir.Node], outputs: set[ir.Value], also: ir.Node | None = None) -> _End | None:
    """The ``[B, S, H * D]`` tensor that ``value`` ``[B, H, S, D]`` is (maybe rotated, then)
    transposed and reshaped into, when that is all that reads it (besides ``also``), or ``None``."""
    first = [node for node in readers(value, outputs) or [] if node is not also]
    swap = first[0] if len(first) == 1 and value not in outputs else None
    rotary = swap if _rotary(swap) and swap.inputs[0] is value else None  # type: ignore[union-attr]
    if rotary is not None:
        swap = single_reader(rotary.outputs[0], outputs, "Transpose")
    if not is_op(swap, "Transpose") or perm(swap) != _SWAP:
        return None
    moved = swap.outputs[0]
    reshape = single_reader(moved, outputs, "Reshape")
    if reshape is None or not _heads_of(reshape.outputs[0], moved):
        return None
    chain.update(n for n in (swap, reshape, rotary) if n is not None)
    return _End(reshape.outputs[0], rotary, _bsd(reshape.outputs[0], moved))


def _as_3d(rw: Rewrite, end: _End, before: ir.Node) -> ir.Value:
    """A source's ``[B, S, H * D]`` view of its 2-D ``flat`` (placed before ``before``), or ``flat``."""
    if end.bsd is None:
        return end.flat
    node = rw.node("Reshape", end.flat, rw.constant("bsd", np.array(end.bsd, np.int64)), name="bsd")
    rw.graph.insert_before(before, node)
    node.outputs[0].shape, node.outputs[0].type = ir.Shape(end.bsd), end.flat.type
    return node.outputs[0]


def _as_flat(rw: Rewrite, end: _End, value: ir.Value, after: ir.Node) -> ir.Value:
    """A sink's 3-D ``value`` as its 2-D ``flat`` (placed after ``after``), or ``value``."""
    if end.bsd is None:
        return value
    node = rw.node("Reshape", value, rw.constant("flat", np.array(list(end.flat.shape), np.int64)), name="flat")  # type: ignore[arg-type]
    rw.graph.insert_after(after, node)
    node.outputs[0].shape, node.outputs[0].type = end.flat.shape, end.flat.type
    return node.outputs[0]


def _rotate(rw: Rewrite, end: _End, value: ir.Value, heads: int) -> ir.Value:
    """``value`` (3-D) through ``end``'s rotary in its 3-D form, placed where that rotary is
    (after its cos/sin inputs and after ``value``'s producer)."""
    if end.rotary is None:
        return value
    attrs = {name: attr for name, attr in end.rotary.attributes.items() if name != "num_heads"}
    node = rw.node("RotaryEmbedding", value, *end.rotary.inputs[1:], name="bshd", like=end.rotary, **attrs,
                   num_heads=heads)
    rw.graph.insert_before(end.rotary, node)
    node.outputs[0].shape, node.outputs[0].type = value.shape, value.type
    return node.outputs[0]


def _backward_of(forward: ir.Node) -> ir.Node | None:
    readers = {node for v in forward.outputs for node, _ in v.uses()}
    backward = [n for n in readers if n.op_type == "SdpaBackward" and n.domain == DOMAIN]
    return backward[0] if len(backward) == 1 else None


def _attributes(node: ir.Node, q_heads: int, kv_heads: int) -> dict[str, object]:
    attrs: dict[str, object] = {name: attr for name, attr in node.attributes.items()
                                if name not in ("q_num_heads", "kv_num_heads")}
    return {**attrs, "q_num_heads": q_heads, "kv_num_heads": kv_heads}


def _rewrite(graph: ir.Graph, forward: ir.Node, names: NameScope, outputs: set[ir.Value]) -> bool:
    q, k, v = forward.inputs[:3]
    if forward.attributes.get_int("q_num_heads", 0) or any(_dims(t, 4) is None for t in (q, k, v)):
        return False  # already 3-D, or not 4-D
    heads = _dims(q, 4)[1], _dims(k, 4)[1]  # type: ignore[index]
    if not all(isinstance(h, int) for h in heads):
        return False
    backward = _backward_of(forward)
    pair = {forward} | ({backward} if backward is not None else set())
    chain: set[ir.Node] = set()
    sources = [_source(t, chain, pair) for t in (q, k, v)]
    y = _sink(forward.outputs[0], chain, outputs, also=backward)
    if any(e is None for e in sources) or y is None or y.rotary is not None:
        return False
    if backward is not None:
        if list(backward.inputs[:4]) != [q, k, v, forward.outputs[0]] or backward.inputs[5] is not forward.outputs[1]:
            return False
        dy = _source(backward.inputs[4], chain, pair)
        grads = [_sink(g, chain, outputs) for g in backward.outputs]
        if dy is None or dy.rotary is not None or any(g is None for g in grads):
            return False
    ends = [*sources, y, *((dy, *grads) if backward is not None else ())]
    if any(e.rotary is not None and e.bsd is not None for e in ends):  # type: ignore[union-attr]
        return False  # a rotary on a 2-D projection: not a form any exporter writes
    per_input = (heads[0], heads[1], heads[1])
    rw = Rewrite(graph, forward.name or "SdpaForward", names=names)
    flats = [_rotate(rw, e, _as_3d(rw, e, forward), h) for e, h in zip(sources, per_input)]  # type: ignore[arg-type]
    fused = rw.node("SdpaForward", *flats, name="bshd", domain=DOMAIN, num_outputs=2, like=forward,
                    **_attributes(forward, *heads))
    graph.insert_before(forward, fused)
    if y.bsd is not None:
        fused.outputs[0].shape, fused.outputs[0].type = ir.Shape(y.bsd), y.flat.type
    hand_over([y.flat, forward.outputs[1]], [_as_flat(rw, y, fused.outputs[0], fused), fused.outputs[1]])
    if backward is not None:
        rw_b = Rewrite(graph, backward.name or "SdpaBackward", names=names)
        dy3 = _as_3d(rw_b, dy, backward)  # type: ignore[arg-type]
        node = rw_b.node("SdpaBackward", *flats, fused.outputs[0], dy3, fused.outputs[1], name="bshd",
                         domain=DOMAIN, num_outputs=3, like=backward, **_attributes(backward, *heads))
        graph.insert_before(backward, node)
        for out, flat in zip(node.outputs, flats):  # dQ, dK, dV as Q, K, V (a rotary after reads them)
            out.shape, out.type = flat.shape, flat.type
        outs = [_as_flat(rw_b, end, _rotate(rw_b, end, out, h), node)  # type: ignore[arg-type]
                for end, out, h in zip(grads, node.outputs, per_input)]
        hand_over([e.flat for e in grads], outs)  # type: ignore[union-attr]
    remove_dead(graph, chain | pair)
    return True


def read_heads_in_place(model: ir.Model) -> int:
    """Rewrite every 4-D ``SdpaForward`` (and its ``SdpaBackward``) of ``model``'s main graph
    whose tensors are transposed ``[B, S, H * D]`` projections to read and write those
    directly, in place; how many forward nodes were rewritten."""
    graph = model.graph
    names = NameScope(graph)
    found = [n for n in graph if n.op_type == "SdpaForward" and n.domain == DOMAIN]
    outputs = set(graph.outputs)
    count = sum(1 for node in found if _rewrite(graph, node, names, outputs))
    if found:
        logger.info("sdpa_layout: %d of %d fused attentions read [B, S, H*D] in place", count, len(found))
    return count
