"""Run ONNX ``RotaryEmbedding`` nodes as the library's one-pass kernel (a session lowering).

Llama-style models rotate Q and K in every layer; the gradient rule applies the same op to
the gradients (``RotaryEmbedding(dy, cos, -sin)``, ``mpgraph/autodiff/rules/attention.py``), and
``sdpa_layout`` moves all four to the op's 3-D ``num_heads`` form. ORT's CUDA kernel
(``RotaryEmbeddingBSNH``) runs one thread an element, one block a row of a head, in T: on the
H200 a Llama-style 125M bf16 step (``[8, 1024, H * 64]``) spends 1.96 ms in its 48 calls, ~41 us
each, where the traffic (X in, Y out, the caches) is a few us. ``ai.mpgraph.RotaryEmbedding``
takes the node as it is (the same inputs, ``position_ids`` or none, and attributes:
``interleaved``, ``rotary_embedding_dim``, ``num_heads``) and runs it as one bandwidth-bound
pass, 16 bytes a load (``csrc/rotary.cu``)::

    Y = RotaryEmbedding(X, cos, sin[, position_ids])    ->    Y = ai.mpgraph.RotaryEmbedding(...)

Two of the graph's small kernels around the nodes go too: the kernel reads caches of
``[1, S, rotary_dim / 2]`` for every batch row (ONNX asks ``[B, S, ...]`` without
``position_ids``, so ``normalize_forward`` expands them: the rule reads the ``Expand``'s input),
and its ``negate_sin`` attribute rotates by -sin (the rule reads the gradient's ``Neg(sin)``'s
input; negation is exact). The Llama-style step's 48 ``Expand`` and 24 ``Neg`` (each a launch
writing ``[8, 1024, 32]``) are then unread and removed.

Each rotated pair ``(x1, x2)`` is computed as MLAS (ORT CPU's AVX2 kernel) does, in float with
one rounding per output: ``y1 = fma(x1, cos, -(x2 * sin))``, ``y2 = fma(x1, sin, x2 * cos)``. On
ORT CPU (float32, the library's reference loop) that is ORT's own result, bit for bit
(``tests/test_lowering_rotary.py``); ORT CUDA rounds each step of its T arithmetic to T, so in
bfloat16 its outputs may differ from the kernel's by an ulp or two (``approximate`` in the
registry's terms: the same terms with fewer roundings, as ``matmul_bias``).

``MPGRAPH_ROTARY=ort`` in the environment turns the rule off (every rotary stays ORT's): the
switch for an A/B of a whole training step, as ``MPGRAPH_GEMM_BIAS=ort`` is for ``gemm_bias``.

Left as they are: X of another type than the provider's kernel takes (float32 on CPU; float32,
float16 or bfloat16 on CUDA), caches of another type than X, ``position_ids`` that is not int64,
X neither 4-D nor 3-D with ``num_heads``, and an odd or too large ``rotary_embedding_dim``.
"""

from __future__ import annotations

import logging
import os

import onnx_ir as ir

from mpgraph.lowering.match import DOMAIN, is_op, remove_dead, replace

__all__ = ["fuse_rotary"]

logger = logging.getLogger(__name__)

_TYPES = {
    "cpu": (ir.DataType.FLOAT,),
    "cuda": (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16),
}
_ATTRS = ("interleaved", "rotary_embedding_dim", "num_heads")


def _takes(node: ir.Node, types: tuple[ir.DataType, ...]) -> bool:
    """Whether the library's kernel computes ``node`` as ONNX defines it."""
    inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
    x, cos, sin, pos = inputs[:4]
    if x is None or cos is None or sin is None or len(node.inputs) > 4 or x.dtype not in types:
        return False
    if cos.dtype != x.dtype or sin.dtype != x.dtype or (pos is not None and pos.dtype != ir.DataType.INT64):
        return False
    rank = len(x.shape) if x.shape is not None else None
    heads, rdim = node.attributes.get_int("num_heads", 0), node.attributes.get_int("rotary_embedding_dim", 0)
    if rank not in (3, 4) or (rank == 3 and heads <= 0) or rdim < 0 or rdim % 2:
        return False
    head = x.shape[3] if rank == 4 else (x.shape[2] // heads if isinstance(x.shape[2], int) else None)  # type: ignore[index]
    return not (isinstance(head, int) and rdim > head)


def _unexpanded(cache: ir.Value, x: ir.Value) -> ir.Value:
    """``cache`` or, where it is ``Expand(c, [B, S, half])`` of a ``[1, S, half]`` c of X's type, c."""
    node = cache.producer()
    if not is_op(node, "Expand") or cache.shape is None or len(cache.shape) != 3:  # type: ignore[arg-type]
        return cache
    src = node.inputs[0]  # type: ignore[union-attr]
    dims = list(src.shape) if src is not None and src.shape is not None else None
    if dims is None or len(dims) != 3 or dims[0] != 1 or dims[1:] != list(cache.shape)[1:] or src.dtype != x.dtype:
        return cache
    return src if all(isinstance(d, int) for d in dims) else cache


def _sources(node: ir.Node) -> tuple[list[ir.Value | None], bool]:
    """The node's inputs with sin read before a ``Neg`` and, without ``position_ids``, both caches
    before an ``Expand`` to the batch; and whether sin was negated."""
    x, cos, sin, *rest = list(node.inputs)
    negated = is_op(sin.producer(), "Neg")  # type: ignore[union-attr]
    if negated:
        sin = sin.producer().inputs[0]  # type: ignore[union-attr]
    if not rest or rest[0] is None:
        c1, s1 = _unexpanded(cos, x), _unexpanded(sin, x)  # type: ignore[arg-type]
        if c1.shape is not None and s1.shape is not None and list(c1.shape) == list(s1.shape):
            cos, sin = c1, s1
    return [x, cos, sin, *rest], negated


def _feeders(node: ir.Node) -> set[ir.Node]:
    """The ``Neg`` and ``Expand`` nodes (and the Expands' shape ``Constant``) the node reads its
    caches through: removed once nothing reads them."""
    found: set[ir.Node] = set()
    todo = [v.producer() for v in node.inputs[1:3] if v is not None]
    while todo:
        n = todo.pop()
        if is_op(n, "Neg") or is_op(n, "Expand"):
            found.add(n)  # type: ignore[arg-type]
            todo += [v.producer() for v in n.inputs if v is not None]  # type: ignore[union-attr]
        elif is_op(n, "Constant"):
            found.add(n)  # type: ignore[arg-type]
    return found


def fuse_rotary(model: ir.Model, provider: str) -> int:
    """Replace every ONNX ``RotaryEmbedding`` in ``model``'s main graph that the library's kernel
    takes on ``provider`` by ``ai.mpgraph.RotaryEmbedding``, in place; how many were replaced."""
    if os.environ.get("MPGRAPH_ROTARY", "") == "ort":
        logger.info("rotary off: MPGRAPH_ROTARY=ort")
        return 0
    graph = model.graph
    types = _TYPES.get(provider, ())
    fused = 0
    dead: set[ir.Node] = set()
    for node in [n for n in graph if is_op(n, "RotaryEmbedding")]:
        if not _takes(node, types):
            continue
        inputs, negated = _sources(node)
        while inputs and inputs[-1] is None:
            inputs.pop()
        attrs = [ir.AttrInt64(name, node.attributes.get_int(name, 0)) for name in _ATTRS if name in node.attributes]
        if negated:
            attrs.append(ir.AttrInt64("negate_sin", 1))
        feeders = _feeders(node)
        new = ir.Node(DOMAIN, "RotaryEmbedding", inputs, attributes=attrs, name=f"{node.name}/fused",
                      metadata_props=dict(node.metadata_props))
        replace(graph, [node], new, (node.outputs[0],), before=node)
        dead |= feeders
        fused += 1
    remove_dead(graph, dead)
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
