"""Fuse ONNX ``Attention`` and its backward into ``SdpaForward`` / ``SdpaBackward`` (a session lowering).

Attention as ONNX ops writes its scores: the forward's ``[B, H, Sq, Skv]`` product, scale,
mask and softmax, and the backward (``autodiff.rules.attention``, which recomputes the
probabilities) its own MatMul, Softmax and the ``dP``/``dS`` products of that size. On the
H200 the GPT-2 small bf16 step spent ~24 ms of 84 in the float32 elementwise chains around them
(issue 30). The fused ops keep the scores inside the kernel (cuDNN's fused attention on CUDA,
``csrc/sdpa.h``; a float32 reference loop on CPU) and pass one float32 log-sum-exp per query
row from the forward to the backward::

    Y = Attention(Q, K, V)                 Y, Stats = SdpaForward(Q, K, V)
    dQ, dK, dV = <the rule's ops>(dY)  ->  dQ, dK, dV = SdpaBackward(Q, K, V, Y, dY, Stats)

(the rule's ops: 47 nodes for the 3-D GQA causal block of ``tests/test_train_attention.py``,
Reshapes and Transposes between the layouts included).

The backward is found by value, never by the nodes the gradient rule emits: autodiff records
on the forward node the gradient flowing into ``Y`` and the node's contribution to each input's
gradient (``_ir.links.gradient_blocks``); the readers of each contribution move onto the fused
output (which takes its name, so other blocks that name it still resolve) and the rule's nodes,
read by nothing now, are removed (``match.swap_backward``, as for the other backward fusions).

Skipped (left as ONNX ops): a mask, a KV cache (inputs 3-6), an extra output that is read, a
softcap, ``qk_matmul_output_mode``, a ``softmax_precision`` other than float32, head dims not
static; on CPU anything not float32; on CUDA anything not all float16 or all bfloat16, head
dims not a multiple of 8 or over 128 (cuDNN's fused attention).

The scale is the gradient rule's: ``r = float32(sqrt(float32(scale)))`` with ``scale`` the
attribute or ``1/sqrt(head_dim)``, and the kernels multiply ``Q K^T`` by ``float32(r * r)``.
ONNX's function body multiplies Q and K by ``r`` each before the MatMul (two roundings), so the
forward scores differ from ORT's by float32 rounding (``same math``), as the order of the sums
and the recomputed probabilities (``exp(s - Stats)``) do.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.links import GradientBlock, gradient_blocks
from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import DOMAIN, cast_to, hand_over, remove_dead, swap_backward

__all__ = ["fuse_attention"]

logger = logging.getLogger(__name__)

_TYPES = {"cpu": ({ir.DataType.FLOAT},), "cuda": ({ir.DataType.FLOAT16}, {ir.DataType.BFLOAT16})}
#: cuDNN's fused attention: head dims a multiple of 8, at most 128.
_CUDA_HEAD_DIM = (8, 128)


@dataclass(frozen=True)
class _Attention:
    """What the fused ops need of one fusable Attention node."""

    node: ir.Node
    q_heads: int  # 0 for 4-D inputs (the kernels read dim 1)
    kv_heads: int
    causal: int
    scale: float


def _static(dim: object) -> int | None:
    return dim if isinstance(dim, int) else None


def _head_dims(node: ir.Node) -> tuple[int, int] | None:
    """``(head_dim, v_head_dim)`` when static (3-D inputs: with the heads attributes)."""
    q, k, v = node.inputs[:3]
    if any(t is None or t.shape is None for t in (q, k, v)) or len({len(t.shape) for t in (q, k, v)}) != 1:  # type: ignore[union-attr]
        return None
    rank = len(q.shape)  # type: ignore[union-attr,arg-type]
    qd, vd = _static(q.shape[-1]), _static(v.shape[-1])  # type: ignore[union-attr,index]
    if rank == 4:
        return (qd, vd) if qd and vd else None
    hq, hkv = node.attributes.get_int("q_num_heads"), node.attributes.get_int("kv_num_heads")
    if rank != 3 or not qd or not vd or not hq or not hkv or qd % hq or vd % hkv:  # type: ignore[operator]
        return None
    return qd // hq, vd // hkv  # type: ignore[operator]


def _scale(node: ir.Node, head_dim: int) -> float:
    """The gradient rule's scale (``autodiff.rules.attention._scale``): the square of
    ``float32(sqrt(scale))``, rounded to float32 once."""
    scale = node.attributes.get_float("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    root = float(np.float32(math.sqrt(np.float32(scale))))
    return float(np.float32(root * root))


def _fusable(node: ir.Node, provider: str) -> _Attention | None:
    """The node's fused form, or ``None`` when the fused ops do not compute it (see the module)."""
    if len(node.inputs) < 3 or any(v is not None for v in node.inputs[3:]):
        return None
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return None
    attrs = node.attributes
    precision = attrs.get_int("softmax_precision")
    if attrs.get_float("softcap", 0.0) or attrs.get_int("qk_matmul_output_mode", 0) or precision not in (None, ir.DataType.FLOAT):
        return None
    dims = _head_dims(node)
    if dims is None:
        return None
    values = [*node.inputs[:3], node.outputs[0]]
    if not any({v.dtype for v in values} == types for types in _TYPES.get(provider, ())):  # type: ignore[union-attr]
        return None
    low, high = _CUDA_HEAD_DIM
    if provider == "cuda" and any(d % low or d > high for d in dims):
        return None
    three_d = len(node.inputs[0].shape) == 3  # type: ignore[union-attr,arg-type]
    return _Attention(node, attrs.get_int("q_num_heads", 0) if three_d else 0,  # type: ignore[arg-type]
                      attrs.get_int("kv_num_heads", 0) if three_d else 0,  # type: ignore[arg-type]
                      attrs.get_int("is_causal", 0), _scale(node, dims[0]))  # type: ignore[arg-type]


def _attributes(a: _Attention) -> dict[str, float | int]:
    return {"scale": a.scale, "is_causal": a.causal, "q_num_heads": a.q_heads, "kv_num_heads": a.kv_heads}


def _forward(graph: ir.Graph, a: _Attention, rw: Rewrite) -> ir.Node:
    """Put ``SdpaForward`` in the Attention node's place (it takes over ``Y``)."""
    node = a.node
    q = node.inputs[0]
    fused = rw.node("SdpaForward", *node.inputs[:3], name="SdpaForward", domain=DOMAIN, num_outputs=2, like=node,
                    **_attributes(a))
    stats = fused.outputs[1]
    stats.dtype = ir.DataType.FLOAT
    if q is not None and q.shape is not None:
        seq = q.shape[2] if len(q.shape) == 4 else q.shape[1]
        heads = q.shape[1] if len(q.shape) == 4 else a.q_heads
        stats.shape = ir.Shape([q.shape[0], heads, seq, 1])
    graph.insert_before(node, fused)
    hand_over([node.outputs[0]], [fused.outputs[0]])
    return fused


def _complete(block: GradientBlock) -> bool:
    """The block has ``dY``, and each input gradient autodiff recorded still resolves (a pass
    may have removed one), each a value of its own."""
    recorded = json.loads(block.node.metadata_props.get(md.NODE_GRAD_INPUTS, "[]"))[:3]
    present = [dx for dx in block.dxs[:3] if dx is not None]
    wanted = sum(1 for name in recorded if name is not None)
    return bool(block.dys) and block.dys[0] is not None and len(present) == wanted > 0 \
        and len({id(dx) for dx in present}) == len(present)


def _backward(graph: ir.Graph, a: _Attention, fused: ir.Node, block: GradientBlock, rw: Rewrite) -> bool:
    """Put ``SdpaBackward`` after ``dY`` (through the Cast of it to Y's type the graph has, or a
    new one) in place of the block's ``dQ``, ``dK``, ``dV`` (``match.swap_backward``); ``False``
    (nothing changed) where the graph order does not allow it."""
    y = fused.outputs[0]
    first = next(dx for dx in block.dxs[:3] if dx is not None).producer()
    meta = dict(first.metadata_props) if first is not None else {}
    dy, dy_cast = cast_to(block.dys[0], y.dtype, rw.names.fresh(f"{rw.scope}/dY_cast"), meta, reuse_in=graph)  # type: ignore[arg-type]
    node = rw.node("SdpaBackward", *fused.inputs, y, dy, fused.outputs[1], name="SdpaBackward", domain=DOMAIN,
                   num_outputs=3, like=first, **_attributes(a))
    for j, out in enumerate(node.outputs):
        out.dtype, out.shape = y.dtype, fused.inputs[j].shape  # type: ignore[union-attr]
    return swap_backward(graph, node, block.dxs[:3], [dy_cast] if dy_cast is not None else [])


def fuse_attention(model: ir.Model, provider: str) -> int:
    """Fuse every fusable ``Attention`` of ``model``'s main graph (and its backward, where the
    graph records it) for ``provider`` (``cpu``: float32; ``cuda``: float16/bfloat16, the
    library must have cuDNN attention), in place; how many Attention nodes were fused."""
    graph = model.graph
    found = [a for node in graph if node.op_type == "Attention" and node.domain in ("", "ai.onnx")
             and (a := _fusable(node, provider)) is not None]
    if not found:
        return 0
    names = NameScope(graph)
    backwards = 0
    for index, a in enumerate(found):
        rw = Rewrite(graph, a.node.name or f"Attention_{index}", names=names)
        # read again each time: a fused block's gradients were handed to new values
        block = gradient_blocks(graph).get(a.node)
        fused = _forward(graph, a, rw)
        if block is not None and _complete(block) and _backward(graph, a, fused, block, rw):
            backwards += 1
        remove_dead(graph, {a.node})
    model.opset_imports.setdefault(DOMAIN, 1)
    logger.info("sdpa: %d Attention nodes fused (%d with their backward)", len(found), backwards)
    return len(found)
