"""Rules 6-9's fusions around the library's fp8 ops, after ``fp8_gemm`` has put the products on
``GemmFp8`` (``fp8_gemm.lower_fp8_gemms`` runs them in this order; ``fp8_layout`` holds rule 6's
layout clean-ups): each amax in one read (``AbsMax``), each quantisation in one pass
(``CastToFloat8*``), a delayed-scaling amax with its cast (rule 7, ``CastToFloat8*Amax``), a bf16
bias in GemmFp8's epilogue (rule 8), the backward's re-quantisation of a saved activation shared
with the forward's and each transposed operand made by its cast (rule 9,
``CastTransposeToFloat8*``). Each returns how many it rewrote.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.lowering.fp8_layout import CAST_OPS
from mpgraph.lowering.match import DOMAIN, hand_over, is_op, same_dim

__all__ = ["LOW_OR_FLOAT", "cast_target", "fuse_amaxes", "fuse_biases", "fuse_cast_amaxes", "fuse_cast_transposes",
           "fuse_scale_casts", "share_saved_casts"]

#: The dtypes an fp8 product's operands and output come in.
LOW_OR_FLOAT = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT)


def cast_target(node: ir.Node | None) -> ir.DataType | None:
    """The type a ``Cast`` node casts to (``None`` for any other node)."""
    if not is_op(node, "Cast"):
        return None
    attr = node.attributes.get("to")  # type: ignore[union-attr]
    return ir.DataType(attr.as_int()) if attr is not None else None


def _unwidened(x: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """``(v, widening)`` where ``x`` is ``Cast(v, float)`` of a bf16/fp16 ``v`` (the same numbers,
    half the bytes to read), else ``(x, None)``."""
    widen = x.producer()
    if cast_target(widen) == ir.DataType.FLOAT and widen.inputs[0] is not None \
            and widen.inputs[0].dtype in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16):  # type: ignore[union-attr]
        return widen.inputs[0], widen  # type: ignore[union-attr,return-value]
    return x, None


def fuse_amaxes(graph: ir.Graph) -> int:
    """Rule 6: each amax the pass wrote, ``ReduceMax(Abs(x), keepdims=0)`` over every axis with
    the ``Abs`` read by nothing else, as the library's ``AbsMax(x)`` (one read of ``x``, no
    float32 copy of ``|x|``; the same value: a maximum is exact), of ``v`` itself where ``x``
    is ``Cast(v, float)`` of a bf16/fp16 ``v`` (the float32 copy then feeds only the scaling,
    which the pointwise rule fuses with the Cast); how many."""
    count = 0
    for node in list(graph):
        if not is_op(node, "ReduceMax") or node.metadata_props.get(md.NODE_INSERTED) != "fp8" or len(node.inputs) != 1:
            continue
        if node.attributes.get_int("keepdims", 1) != 0 or node.inputs[0] is None:
            continue
        absolute = node.inputs[0].producer()
        if not is_op(absolute, "Abs") or len(node.inputs[0].uses()) != 1 or node.inputs[0] in graph.outputs:
            continue
        x = absolute.inputs[0]  # type: ignore[union-attr]
        if x is None or x.dtype not in LOW_OR_FLOAT:
            continue
        x, _ = _unwidened(x)  # |float32(v)| of a bf16/fp16 v is |v|: read v, half the bytes
        fused = ir.node("AbsMax", [x], domain=DOMAIN, name=f"{node.name}/AbsMax", metadata_props=dict(node.metadata_props))
        graph.insert_before(node, fused)
        hand_over(node.outputs, fused.outputs)
        graph.remove([node, absolute], safe=True)  # type: ignore[list-item]
        count += 1
    return count


def fuse_scale_casts(graph: ir.Graph) -> int:
    """Rule 6: each quantisation ``Cast(Mul(x, s), fp8, saturate=1)`` whose product nothing
    else reads, as the library's ``CastToFloat8E4M3FN/E5M2(x, s)`` (one read of ``x``, a byte
    written an element; the product rounds to float32 as before), of ``v`` itself where ``x``
    is ``Cast(v, float)`` of a bf16/fp16 ``v``; how many."""
    count = 0
    for node in list(graph):
        to = cast_target(node)
        if to not in CAST_OPS or node.attributes.get_int("saturate", 1) != 1 or node.inputs[0] is None:
            continue
        scaled = node.inputs[0]
        mul = scaled.producer()
        if not is_op(mul, "Mul") or len(scaled.uses()) != 1 or scaled in graph.outputs:
            continue
        x, scale = mul.inputs  # type: ignore[union-attr]
        if x is None or scale is None or x.dtype != ir.DataType.FLOAT or scale.dtype != ir.DataType.FLOAT \
                or scale.shape is None or scale.shape.rank() != 0:
            continue
        x, widen = _unwidened(x)
        fused = ir.node(CAST_OPS[to], [x, scale], domain=DOMAIN, name=f"{node.name}/{CAST_OPS[to]}",
                        metadata_props=dict(node.metadata_props))
        graph.insert_before(node, fused)
        hand_over(node.outputs, fused.outputs)
        graph.remove(node, safe=True)
        for dead in (mul, widen):
            if dead is not None and dead.graph is not None and all(not v.uses() and v not in graph.outputs for v in dead.outputs):
                graph.remove(dead, safe=True)
        count += 1
    return count


def _depends_on(value: ir.Value, node: ir.Node, limit: int = 256) -> bool:
    """Whether ``value`` is computed from ``node``'s outputs (looked for through at most
    ``limit`` producers; more counts as yes)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        producer = todo.pop().producer()
        if producer is None or id(producer) in seen:
            continue
        if producer is node or len(seen) >= limit:
            return True
        seen.add(id(producer))
        todo.extend(v for v in producer.inputs if v is not None)
    return False


def fuse_cast_amaxes(graph: ir.Graph) -> int:
    """Rule 7: an ``AbsMax(x)`` and a ``CastToFloat8*(x, s)`` of the same ``x`` whose scale ``s``
    does not come from that amax (the delayed recipe: ``s`` is from earlier steps' amaxes; the
    current recipe's ``s`` is from this one, and stays two passes) become one
    ``CastToFloat8*Amax(x, s) -> (q, amax)``: ``x`` read once, where the two read it twice (the
    fp8 ``gemm`` step's census: ``AbsMax`` 1.64 GB of its 24.80 GB a step). The same bits: the
    amax is a maximum of the same values, the cast element-wise. Placed before the first of the
    two where ``s`` is computed before it, else before the cast where nothing reads the amax
    earlier; otherwise left. How many."""
    fused_ops = {name: f"{name}Amax" for name in CAST_OPS.values()}
    order = {id(n): i for i, n in enumerate(graph)}
    count = 0
    for amax in list(graph):
        if not (amax.domain == DOMAIN and amax.op_type == "AbsMax") or amax.inputs[0] is None:
            continue
        x = amax.inputs[0]
        casts = [u.node for u in x.uses() if u.idx == 0 and u.node.domain == DOMAIN and u.node.op_type in fused_ops
                 and u.node.inputs[1] is not None and not _depends_on(u.node.inputs[1], amax)]
        if not casts:
            continue
        cast = min(casts, key=lambda n: order[id(n)])
        scale = cast.inputs[1]
        first = min((amax, cast), key=lambda n: order[id(n)])
        made = scale.producer()  # type: ignore[union-attr]
        if made is None or order.get(id(made), -1) < order[id(first)]:
            where = first
        elif all(order[id(u.node)] > order[id(cast)] for u in amax.outputs[0].uses()):
            where = cast
        else:
            continue
        fused = ir.node(fused_ops[cast.op_type], [x, scale], domain=DOMAIN, num_outputs=2,
                        name=f"{cast.name}/Amax", metadata_props=dict(cast.metadata_props))
        graph.insert_before(where, fused)
        order[id(fused)] = order[id(where)]
        hand_over(cast.outputs, fused.outputs[:1])
        hand_over(amax.outputs, fused.outputs[1:])
        graph.remove([cast, amax], safe=True)
        count += 1
    return count


def share_saved_casts(graph: ir.Graph) -> int:
    """Rule 9, first half: the backward's quantisation of a saved activation,
    ``CastToFloat8*(Flatten/Reshape(x), s)`` with the forward's scale ``s``, is the forward's own
    ``q`` of ``x`` where its readers flatten leading dims themselves (``Fp8Transpose``, GemmFp8's
    ``A``) and the last dim is kept: the same bytes in the same order. They read the forward's
    ``q``; the backward's cast (a second read of ``x``, kept alive for it) goes, and the forward's
    cast then makes the transpose too (``fuse_cast_transposes``). How many."""
    count = 0
    for cast in list(graph):
        if not (cast.domain == DOMAIN and cast.op_type in CAST_OPS.values()) or cast.graph is None:
            continue
        v, scale = cast.inputs
        view = v.producer() if v is not None else None
        if view is None or view.op_type not in ("Flatten", "Reshape") or view.domain not in ("", "ai.onnx"):
            continue
        x = view.inputs[0]
        if x is None or x.shape is None or v.shape is None or not same_dim(x.shape[-1], v.shape[-1]):
            continue
        q = cast.outputs[0]
        readers = list(q.uses())
        if not readers or q in graph.outputs or not all(
                u.idx == 0 and u.node.domain == DOMAIN and (u.node.op_type == "Fp8Transpose" or (
                    u.node.op_type == "GemmFp8" and md.NODE_FP8_SWAPPED not in u.node.metadata_props)) for u in readers):
            continue
        forward = next((u.node for u in x.uses() if u.idx == 0 and u.node is not cast and u.node.domain == DOMAIN
                        and u.node.op_type in (cast.op_type, f"{cast.op_type}Amax") and u.node.inputs[1] is scale), None)
        if forward is None:
            continue
        for use in readers:
            use.node.replace_input_with(0, forward.outputs[0])
        graph.remove(cast, safe=True)
        if not v.uses() and v not in graph.outputs:
            graph.remove(view, safe=True)
        count += 1
    return count


def fuse_cast_transposes(graph: ir.Graph) -> int:
    """Rule 9: a ``CastToFloat8*Amax(x, s)`` whose ``q`` an ``Fp8Transpose`` reads is one
    ``CastTransposeToFloat8*(x, s) -> (q, qT, amax)``: ``qT`` from the tile of ``x`` the cast
    already holds, as Transformer Engine's cast-transpose, where the transpose read ``q`` again in
    its own launch (every GEMM operand of a step has one: the weight gradient reads the
    activation and the output gradient transposed, the input gradient the weight; d4096's
    profile: 51 transposes, 2.8 ms a step). The same bits. How many."""
    fused_ops = {f"{name}Amax": name.replace("CastTo", "CastTransposeTo") for name in CAST_OPS.values()}
    count = 0
    for cast in list(graph):
        if not (cast.domain == DOMAIN and cast.op_type in fused_ops) or cast.graph is None:
            continue
        q = cast.outputs[0]
        flips = [u.node for u in q.uses() if u.idx == 0 and u.node.domain == DOMAIN and u.node.op_type == "Fp8Transpose"]
        if not flips or flips[0].outputs[0] in graph.outputs or q.shape is None or q.shape.rank() < 2:
            continue
        flip = flips[0]
        fused = ir.node(fused_ops[cast.op_type], list(cast.inputs), domain=DOMAIN, num_outputs=3,
                        name=f"{cast.name}/Transpose", metadata_props=dict(cast.metadata_props))
        graph.insert_before(cast, fused)
        hand_over([cast.outputs[0], flip.outputs[0], cast.outputs[1]], fused.outputs)
        graph.remove([flip, cast], safe=True)
        count += 1
    return count


def fuse_biases(graph: ir.Graph) -> int:
    """Rule 8: ``Add(GemmFp8(A', B', sa, sb), bias)``, through the ``Reshape`` back to a 3-D
    activation's shape where there is one, with ``bias`` a bf16 ``[N]`` and the product read by
    nothing else, is ``GemmFp8(A', B', sa, sb, bias)``: cuBLASLt's bias epilogue, as ``GemmBias``
    does in bf16, where the Add read and wrote the whole product again (the fp8 ``gemm`` step's
    census: 4 Adds, 1.09 GB a step; d4096's profile: 8 of them, 2.1 ms). The sum is rounded to
    bf16 once, where the Add rounded the product and then the sum. How many."""
    order = {id(n): i for i, n in enumerate(graph)}
    count = 0
    for gemm in list(graph):
        if not (gemm.domain == DOMAIN and gemm.op_type == "GemmFp8") or len(gemm.inputs) != 4:
            continue
        y = gemm.outputs[0]
        if y.shape is None or y.shape.rank() != 2 or not isinstance(y.shape[1], int) or y in graph.outputs:
            continue
        uses = list(y.uses())
        view = uses[0].node if len(uses) == 1 and is_op(uses[0].node, "Reshape") and uses[0].idx == 0 else None
        out = view.outputs[0] if view is not None else y
        if view is not None and (out in graph.outputs or out.shape is None or out.shape.rank() < 1
                                 or out.shape[-1] != y.shape[1]):
            continue
        reads = list(out.uses())
        add = reads[0].node if len(reads) == 1 and is_op(reads[0].node, "Add") else None
        if add is None or (view is None and len(uses) != 1):
            continue
        bias = add.inputs[1 - reads[0].idx]
        if bias is None or bias.dtype != ir.DataType.BFLOAT16 or y.dtype != ir.DataType.BFLOAT16 \
                or bias.shape is None or list(bias.shape) != [y.shape[1]]:
            continue
        made = bias.producer()
        if made is not None and order.get(id(made), len(order)) > order[id(gemm)]:
            continue
        fused = ir.Node(DOMAIN, "GemmFp8", [*gemm.inputs, bias],
                        attributes=[ir.AttrFloat32("alpha", gemm.attributes.get_float("alpha", 1.0))],
                        metadata_props=dict(gemm.metadata_props))
        graph.insert_before(gemm, fused)
        hand_over(gemm.outputs, fused.outputs)
        hand_over(add.outputs, [out if view is not None else fused.outputs[0]])
        name = gemm.name
        graph.remove([gemm, add], safe=True)
        fused.name = name  # the product's name, as every other GemmFp8 (byte pins, plan caches)
        count += 1
    return count
