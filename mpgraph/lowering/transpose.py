"""Fold transposes into the matrix multiplies that read them (a session lowering).

A step graph is full of ``Transpose`` nodes that only feed a matrix multiply: torch's exporters
write ``Linear`` as ``MatMul(x, Transpose(W))``, and every matmul's backward transposes one
operand of each of its two products. On ONNX Runtime each is a kernel that copies the tensor
(the bench GPT's bf16 step ran 162 of them). BLAS reads a transposed operand for free, so:

- ``MatMul(Transpose(A), B)`` and ``MatMul(A, Transpose(B))``, where the transpose swaps the
  last two axes, become ``com.microsoft.FusedMatMul`` with ``transA``/``transB`` (ORT's CUDA
  provider has it for float, float16 and bfloat16; its CPU provider for float only);
- ``Gemm`` reading a 2-D ``Transpose`` flips its ``transA``/``transB``;
- ``Transpose(Gemm(A, B))`` without a bias becomes ``Gemm(B, A)`` with both flags flipped
  (``(AB)^T = B^T A^T``), the weight gradient of a ``MatMul(x, Transpose(W))``.

Each is exact algebra on the same BLAS call; a transpose no longer read is removed.

``fold_scales`` moves a multiplication by a power-of-two constant into the ``alpha`` of the
matmuls around it: the attention's ``Mul(QK^T, 1/sqrt(d))`` (d a power of four) into the
product before it, and the same Mul's backward into the two products after it. Scaling by a
power of two is exact, so the results are the same bits (outside float overflow/underflow).

Like the other lowerings in this package these rewrite a session's copy; saved graphs keep
standard ops.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import constant, replace

__all__ = ["fold_scales", "fold_transposes"]

MS_DOMAIN = "com.microsoft"
_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _swap_last_two(node: ir.Node | None) -> ir.Value | None:
    """The input of ``node`` when it is a ``Transpose`` swapping just the last two axes."""
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm_attr = node.attributes.get("perm")
    x = node.inputs[0]
    if perm_attr is None or x is None or x.shape is None:
        return None
    perm = list(perm_attr.as_ints())
    rank = len(perm)
    if rank < 2 or perm != [*range(rank - 2), rank - 1, rank - 2]:
        return None
    return x


def _foldable_type(value: ir.Value, provider: str) -> bool:
    return value.dtype == ir.DataType.FLOAT or (provider == "cuda" and value.dtype in _LOW)


def _fold_matmul(graph: ir.Graph, node: ir.Node, provider: str, names: NameScope) -> bool:
    a, b = node.inputs
    if a is None or b is None or not _foldable_type(a, provider):
        return False
    sources = [_swap_last_two(v.producer()) for v in (a, b)]
    if sources == [None, None]:
        return False
    inputs = [s if s is not None else v for s, v in zip(sources, (a, b))]
    fused = Rewrite(graph, node.name or "matmul", names=names).node(
        "FusedMatMul", *inputs, name="FusedMatMul", domain=MS_DOMAIN, like=node,
        alpha=1.0, transA=int(sources[0] is not None), transB=int(sources[1] is not None))
    _swap_in(graph, node, fused)
    return True


def _flag(node: ir.Node, name: str) -> int:
    attr = node.attributes.get(name)
    return attr.as_int() if attr is not None else 0


def _gemm_attrs(node: ir.Node, trans_a: int, trans_b: int) -> list[ir.Attr]:
    keep = [a for name, a in node.attributes.items() if name not in ("transA", "transB")]
    return [*keep, ir.AttrInt64("transA", trans_a), ir.AttrInt64("transB", trans_b)]


def _fold_gemm_inputs(node: ir.Node, provider: str) -> bool:
    """A ``Gemm`` reading a 2-D ``Transpose`` reads its input instead, its flag flipped (in place)."""
    a, b = node.inputs[:2]
    if a is None or b is None or not _foldable_type(a, provider):
        return False
    sources = [_swap_last_two(v.producer()) for v in (a, b)]
    if sources == [None, None] or any(s is not None and len(s.shape) != 2 for s in sources):  # type: ignore[arg-type]
        return False
    inputs = [s if s is not None else v for s, v in zip(sources, (a, b))]
    ta, tb = _flag(node, "transA") ^ (sources[0] is not None), _flag(node, "transB") ^ (sources[1] is not None)
    attrs = _gemm_attrs(node, ta, tb)
    for slot, value in enumerate(inputs):
        node.replace_input_with(slot, value)
    node.attributes.clear()
    node.attributes.update({attr.name: attr for attr in attrs})
    return True


def _fold_transposed_gemm(graph: ir.Graph, transpose: ir.Node, outputs: set[ir.Value], names: NameScope) -> bool:
    """``Transpose(Gemm(A, B), (1, 0))`` -> ``Gemm(B, A)`` with both flags flipped."""
    y = _swap_last_two(transpose)
    gemm = y.producer() if y is not None else None
    if gemm is None or gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx") or len(gemm.inputs) > 2:
        return False
    if len(y.uses()) != 1 or y in outputs:  # type: ignore[union-attr]
        return False
    a, b = gemm.inputs
    attrs = _gemm_attrs(gemm, 1 - _flag(gemm, "transB"), 1 - _flag(gemm, "transA"))
    swapped = Rewrite(graph, gemm.name or "gemm", names=names).node(
        "Gemm", b, a, name="transposed", like=gemm, **{attr.name: attr for attr in attrs})
    _swap_in(graph, transpose, swapped)
    graph.remove(gemm, safe=True)
    return True


def _swap_in(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Put ``new`` where ``old`` is and give it ``old``'s output (name, readers, slot)."""
    replace(graph, [old], new, (old.outputs[0],), before=old)


def fold_transposes(model: ir.Model, provider: str = "cuda") -> int:
    """Fold ``model``'s transposes into the matmuls and Gemms that read them, in place.

    Args:
        model: A step or inference graph (its main graph is rewritten).
        provider: ``cuda`` folds float, float16 and bfloat16 products; ``cpu`` float only
            (ORT's CPU provider has ``FusedMatMul`` for float alone).

    Returns:
        How many transposes were removed.
    """
    graph = model.graph
    outputs = set(graph.outputs)
    before = sum(1 for n in graph if n.op_type == "Transpose")
    names = NameScope(graph)
    for node in list(graph):
        if node.graph is None or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Transpose":
            _fold_transposed_gemm(graph, node, outputs, names)
        elif node.op_type == "MatMul":
            _fold_matmul(graph, node, provider, names)
        elif node.op_type == "Gemm":
            _fold_gemm_inputs(node, provider)
    dead = [n for n in graph if n.op_type == "Transpose" and not n.outputs[0].uses() and n.outputs[0] not in outputs]
    graph.remove(dead, safe=True)
    removed = before - sum(1 for n in graph if n.op_type == "Transpose")
    if removed:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return removed


def _power_of_two(value: ir.Value | None) -> float | None:
    array = constant(value)
    if array is None or array.size != 1:
        return None
    c = float(array.reshape(-1)[0])
    return c if c != 0 and math.isfinite(c) and abs(math.frexp(c)[0]) == 0.5 else None


def _as_fused(graph: ir.Graph, node: ir.Node, names: NameScope) -> ir.Node:
    """``node`` itself when it is a ``FusedMatMul``; a plain ``MatMul`` becomes one (alpha 1)."""
    if node.op_type == "FusedMatMul":
        return node
    fused = Rewrite(graph, node.name or "matmul", names=names).node(
        "FusedMatMul", *node.inputs, name="FusedMatMul", domain=MS_DOMAIN, like=node, alpha=1.0, transA=0, transB=0)
    _swap_in(graph, node, fused)
    return fused


def _scale_alpha(node: ir.Node, c: float) -> None:
    alpha = node.attributes.get("alpha")
    node.attributes["alpha"] = ir.AttrFloat32("alpha", (alpha.as_float() if alpha is not None else 1.0) * c)


def _is_matmul(node: ir.Node | None) -> bool:
    return node is not None and ((node.op_type == "MatMul" and node.domain in ("", "ai.onnx"))
                                 or (node.op_type == "FusedMatMul" and node.domain == MS_DOMAIN))


def _fold_scale(graph: ir.Graph, mul: ir.Node, provider: str, outputs: set[ir.Value], names: NameScope) -> bool:
    for slot in (0, 1):
        v, c = mul.inputs[slot], _power_of_two(mul.inputs[1 - slot])
        out = mul.outputs[0]
        if v is None or c is None or not _foldable_type(v, provider) or out.dtype not in (None, v.dtype) or out in outputs:
            continue
        producer = v.producer()
        if _is_matmul(producer) and len(v.uses()) == 1 and v not in outputs:
            fused = _as_fused(graph, producer, names)  # type: ignore[arg-type]
            _scale_alpha(fused, c)
            v = fused.outputs[0]
        elif out.uses() and all(_is_matmul(u.node) for u in out.uses()):
            for reader in list({id(u.node): u.node for u in out.uses()}.values()):
                fused = _as_fused(graph, reader, names)
                slots = [i for i, x in enumerate(fused.inputs) if x is out]
                for i in slots:
                    fused.replace_input_with(i, v)
                _scale_alpha(fused, c ** len(slots))  # (cA)(cA) = c^2 AA
            graph.remove(mul, safe=True)
            return True
        else:
            continue
        keep = mul.outputs[0]
        keep.replace_all_uses_with(v)
        name = keep.name
        keep.name = None
        v.name = name
        graph.remove(mul, safe=True)
        return True
    return False


def fold_scales(model: ir.Model, provider: str = "cuda") -> int:
    """Fold multiplications by power-of-two constants into neighbouring matmuls' ``alpha``
    (``FusedMatMul``), in place; how many ``Mul`` nodes were removed."""
    graph = model.graph
    outputs = set(graph.outputs)
    folded = 0
    names = NameScope(graph)
    for node in list(graph):
        if node.graph is not None and node.op_type == "Mul" and node.domain in ("", "ai.onnx"):
            folded += _fold_scale(graph, node, provider, outputs, names)
    if folded:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return folded
