"""Rule 6's layout clean-ups after ``fp8_gemm`` has put the products on the library's ``GemmFp8``:
no float transpose left beside an fp8 one.

Measured on the CPU plan of the fp8 ``gemm`` GPT (``benchmarks/results/
step_census_fp8_gemm_2026-12-03T13.txt``): 18 bf16 Transposes (0.94 GB a step) that
``fold_transposes`` folds into ``Gemm`` in bf16 stayed in fp8, since GemmFp8 takes one layout
(``A' [M, K]``, ``B' [N, K]``). Half were the exported weights' ``Transpose(W)`` before their
quantisation (``quantise_before_transposes``, ``cancel_fp8_transposes``), half the weight
gradients' ``[K, N] -> [N, K]`` after their product (``absorb_output_transposes``). Each rewrite
leaves every bit as it was (a cast and a maximum do not see the order; a product's transpose is
the product of its operands swapped).
"""

from __future__ import annotations

import json

import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.lowering.match import DOMAIN, hand_over, is_op

__all__ = ["CAST_OPS", "absorb_output_transposes", "cancel_fp8_transposes", "quantise_before_transposes"]

#: The library's fp8 quantisation of each format (``fp8_fuse.fuse_scale_casts`` writes them).
CAST_OPS = {ir.DataType.FLOAT8E4M3FN: "CastToFloat8E4M3FN", ir.DataType.FLOAT8E5M2: "CastToFloat8E5M2"}


def quantise_before_transposes(graph: ir.Graph) -> int:
    """Rule 6: a 2-D ``Transpose(w)`` read only by the amaxes and quantisations (an exported
    ``Linear``'s ``MatMul(x, Transpose(W))``) goes: ``AbsMax`` reads ``w`` (a maximum does not
    see the order) and each ``CastToFloat8*(Transpose(w), s)`` becomes
    ``Fp8Transpose(CastToFloat8*(w, s))`` (the same bits: the cast is element-wise). A float
    transpose of 2 or 4 bytes an element becomes one of 1 byte, and where a product wants ``w``'s
    own layout (the forward, whose ``B'`` is ``[N, K]``) ``cancel_fp8_transposes`` removes the
    pair. How many transposes went."""
    count = 0
    readers = ("AbsMax", *CAST_OPS.values())
    for node in list(graph):
        if not is_op(node, "Transpose") or node.inputs[0] is None:
            continue
        w, x = node.inputs[0], node.outputs[0]
        perm = node.attributes.get_ints("perm", None)
        if w.shape is None or w.shape.rank() != 2 or (perm is not None and list(perm) != [1, 0]):
            continue
        uses = list(x.uses())
        if not uses or x in graph.outputs or not all(
                u.node.domain == DOMAIN and u.node.op_type in readers and u.idx == 0 for u in uses):
            continue
        for use in uses:
            reader = use.node
            if reader.op_type == "AbsMax":
                reader.replace_input_with(0, w)
                continue
            cast = ir.node(reader.op_type, [w, reader.inputs[1]], domain=DOMAIN, name=f"{reader.name}/untransposed",
                           metadata_props=dict(reader.metadata_props))
            flip = ir.node("Fp8Transpose", [cast.outputs[0]], domain=DOMAIN, name=f"{reader.name}/Fp8Transpose",
                           metadata_props=dict(reader.metadata_props))
            graph.insert_before(reader, [cast, flip])
            cast.outputs[0].name, cast.outputs[0].dtype = cast.name, reader.outputs[0].dtype
            cast.outputs[0].shape = ir.Shape(list(w.shape))
            hand_over(reader.outputs, flip.outputs)
            graph.remove(reader, safe=True)
        graph.remove(node, safe=True)
        count += 1
    return count


def cancel_fp8_transposes(graph: ir.Graph) -> int:
    """``Fp8Transpose(Fp8Transpose(q))`` of a 2-D ``q`` is ``q``: its readers read ``q``; how many
    pairs (or outer halves, where the inner one has other readers) went."""
    count = 0
    for node in list(graph):
        if node.graph is None or not (node.domain == DOMAIN and node.op_type == "Fp8Transpose"):
            continue
        inner = node.inputs[0].producer() if node.inputs[0] is not None else None
        if inner is None or not (inner.domain == DOMAIN and inner.op_type == "Fp8Transpose"):
            continue
        q, y = inner.inputs[0], node.outputs[0]
        if q is None or q.shape is None or q.shape.rank() != 2 or y in graph.outputs:
            continue
        y.replace_all_uses_with(q)
        graph.remove(node, safe=True)
        if not inner.outputs[0].uses() and inner.outputs[0] not in graph.outputs:
            graph.remove(inner, safe=True)
        count += 1
    return count


def absorb_output_transposes(graph: ir.Graph) -> int:
    """Rule 6: ``Transpose(GemmFp8(A', B', sa, sb))`` (2-D, the GemmFp8 read by nothing else) is
    ``GemmFp8(B', A', sb, sa)``: ``(A' B'^T)^T = B' A'^T``, the same operands in the other slots
    (a weight gradient written ``[K, N]`` and transposed to the weight's ``[N, K]`` after, which
    ``fold_transposes`` folds into a bf16 ``Gemm`` but cannot into GemmFp8's fixed layout). Its
    rows become the product's N, so only where they are a static multiple of 16; the new node
    says so in ``mpgraph.fp8_swapped``. How many."""
    count = 0
    for node in list(graph):
        if not is_op(node, "Transpose") or node.inputs[0] is None:
            continue
        y = node.inputs[0]
        gemm = y.producer()
        perm = node.attributes.get_ints("perm", None)
        if gemm is None or not (gemm.domain == DOMAIN and gemm.op_type == "GemmFp8") or len(gemm.inputs) != 4:
            continue
        if (perm is not None and list(perm) != [1, 0]) or y.shape is None or y.shape.rank() != 2:
            continue
        rows = y.shape[0]
        if not isinstance(rows, int) or rows % 16 or len(y.uses()) != 1 or y in graph.outputs:
            continue
        a, b, sa, sb = gemm.inputs
        swapped = ir.Node(DOMAIN, "GemmFp8", [b, a, sb, sa],
                          attributes=[ir.AttrFloat32("alpha", gemm.attributes.get_float("alpha", 1.0))],
                          metadata_props={**gemm.metadata_props, md.NODE_FP8_SWAPPED: "1"})
        if md.NODE_FP8 in swapped.metadata_props:  # its slots follow the operands
            slots = json.loads(swapped.metadata_props[md.NODE_FP8])
            swap = {"0": "1", "1": "0"}
            swapped.metadata_props[md.NODE_FP8] = json.dumps({swap.get(k, k): v for k, v in slots.items()}, sort_keys=True)
        graph.insert_before(node, swapped)
        hand_over(node.outputs, swapped.outputs)
        name = gemm.name
        graph.remove([node, gemm], safe=True)
        swapped.name = name  # the product's name, as every other GemmFp8 (byte pins, plan caches)
        count += 1
    return count
