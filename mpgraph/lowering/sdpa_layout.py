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
and ``[B, S, H, D]``. The pair is rewritten together or not at all (a forward without a
backward, in an evaluation graph, alone): every one of its 4-D tensors must come from, or go
only to, such a chain. The kernels compute the same sums in the same order on either layout:
bit-identical.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import DOMAIN, hand_over, perm, producer, remove_dead

__all__ = ["read_heads_in_place"]

logger = logging.getLogger(__name__)

_SWAP = [0, 2, 1, 3]


def _dims(value: ir.Value | None, rank: int) -> list | None:
    shape = value.shape if value is not None else None
    return list(shape) if shape is not None and len(shape) == rank else None


def _heads_of(flat: ir.Value, split: ir.Value) -> bool:
    """``split`` ``[B, S, H, D]`` is ``flat`` ``[B, S, H * D]`` with its last axis cut into heads."""
    f, s = _dims(flat, 3), _dims(split, 4)
    if f is None or s is None or not all(isinstance(d, int) for d in (f[2], s[2], s[3])):
        return False
    return f[:2] == s[:2] and f[2] == s[2] * s[3]


def _source(value: ir.Value | None, chain: set[ir.Node]) -> ir.Value | None:
    """The ``[B, S, H * D]`` tensor ``value`` ``[B, H, S, D]`` was transposed from, or ``None``."""
    swap = producer(value, "Transpose")
    reshape = producer(swap.inputs[0], "Reshape") if swap is not None else None
    if reshape is None or perm(swap) != _SWAP or reshape.inputs[0] is None:
        return None
    flat = reshape.inputs[0]
    if not _heads_of(flat, reshape.outputs[0]):
        return None
    chain.update((swap, reshape))  # type: ignore[arg-type]
    return flat


def _sink(value: ir.Value, chain: set[ir.Node], also: ir.Node | None = None) -> ir.Value | None:
    """The ``[B, S, H * D]`` tensor that ``value`` ``[B, H, S, D]`` is transposed and reshaped
    into, when that is all that reads it (besides ``also``), or ``None``."""
    if value.is_graph_output():
        return None
    readers = [node for node, _ in value.uses() if node is not also]
    if len(readers) != 1:
        return None
    swap = readers[0]
    if swap.op_type != "Transpose" or swap.domain not in ("", "ai.onnx") or perm(swap) != _SWAP:
        return None
    moved = swap.outputs[0]
    if moved.is_graph_output() or len(moved.uses()) != 1:
        return None
    reshape = next(iter(moved.uses()))[0]
    if reshape.op_type != "Reshape" or reshape.domain not in ("", "ai.onnx") or not _heads_of(reshape.outputs[0], moved):
        return None
    chain.update((swap, reshape))
    return reshape.outputs[0]


def _backward_of(forward: ir.Node) -> ir.Node | None:
    readers = {node for v in forward.outputs for node, _ in v.uses()}
    backward = [n for n in readers if n.op_type == "SdpaBackward" and n.domain == DOMAIN]
    return backward[0] if len(backward) == 1 else None


def _attributes(node: ir.Node, q_heads: int, kv_heads: int) -> dict[str, object]:
    attrs: dict[str, object] = {name: attr for name, attr in node.attributes.items()
                                if name not in ("q_num_heads", "kv_num_heads")}
    return {**attrs, "q_num_heads": q_heads, "kv_num_heads": kv_heads}


def _rewrite(graph: ir.Graph, forward: ir.Node, names: NameScope) -> bool:
    q, k, v = forward.inputs[:3]
    if forward.attributes.get_int("q_num_heads", 0) or any(_dims(t, 4) is None for t in (q, k, v)):
        return False  # already 3-D, or not 4-D
    chain: set[ir.Node] = set()
    flats = [_source(t, chain) for t in (q, k, v)]
    backward = _backward_of(forward)
    y = _sink(forward.outputs[0], chain, also=backward)
    if any(f is None for f in flats) or y is None:
        return False
    if backward is not None:
        if list(backward.inputs[:4]) != [q, k, v, forward.outputs[0]] or backward.inputs[5] is not forward.outputs[1]:
            return False
        dy = _source(backward.inputs[4], chain)
        grads = [_sink(g, chain) for g in backward.outputs]
        if dy is None or any(g is None for g in grads):
            return False
    heads = _dims(q, 4)[1], _dims(k, 4)[1]  # type: ignore[index]
    if not all(isinstance(h, int) for h in heads):
        return False
    rw = Rewrite(graph, forward.name or "SdpaForward", names=names)
    fused = rw.node("SdpaForward", *flats, name="bshd", domain=DOMAIN, num_outputs=2, like=forward,
                    **_attributes(forward, *heads))
    graph.insert_before(forward, fused)
    hand_over([y, forward.outputs[1]], fused.outputs)
    if backward is not None:
        rw_b = Rewrite(graph, backward.name or "SdpaBackward", names=names)
        node = rw_b.node("SdpaBackward", *flats, fused.outputs[0], dy, fused.outputs[1], name="bshd", domain=DOMAIN,
                         num_outputs=3, like=backward, **_attributes(backward, *heads))
        graph.insert_before(backward, node)
        hand_over(grads, node.outputs)  # type: ignore[arg-type]
    remove_dead(graph, chain | {forward} | ({backward} if backward is not None else set()))
    return True


def read_heads_in_place(model: ir.Model) -> int:
    """Rewrite every 4-D ``SdpaForward`` (and its ``SdpaBackward``) of ``model``'s main graph
    whose tensors are transposed ``[B, S, H * D]`` projections to read and write those
    directly, in place; how many forward nodes were rewritten."""
    graph = model.graph
    names = NameScope(graph)
    found = [n for n in graph if n.op_type == "SdpaForward" and n.domain == DOMAIN]
    count = sum(1 for node in found if _rewrite(graph, node, names))
    if found:
        logger.info("sdpa_layout: %d of %d fused attentions read [B, S, H*D] in place", count, len(found))
    return count
