"""Fuse the backward of a SwiGLU, ``(a * Sigmoid(a)) * b``, into ``SwiGluGrad`` (a session lowering).

Llama's MLP is ``down(silu(gate(x)) * up(x))``; both torch exporters write SiLU as
``Mul(a, Sigmoid(a))`` (ONNX has no SiLU op before opset 24's ``Swish``, which ORT lacks), so
the canonical form is three standard ops. Their gradient rules (``Mul``, ``Sigmoid``) give::

    db = Mul(dy, h);  dh = Mul(dy, b)                          h = Mul(a, s), s = Sigmoid(a)
    da1 = Mul(dh, s); ds = Mul(dh, a); da2 = Mul(ds, Mul(s, Sub(1, s)))

and the driver sums a's two contributions (under a bf16 policy: both cast to float32, a
``Sum``, a Cast back for the gate projection's backward): ten kernels over the MLP's widest
activation (a Llama-style 125M: ``[8, 1024, 2048]`` bfloat16, 12 layers).
``SwiGluGrad(dy, a, b, s) -> (da, db)`` reads dy, a, b and the forward's s once and writes da
and db. It computes the ops' terms in the ops' order, each rounded to a's type, and adds the
two contributions in float32 before rounding once, as ``Cast(Sum(...))`` does: ``same math``
(on ORT CPU, float32, the same bits; ``tests/test_lowering_swiglu.py``).

The rule finds it by value: the three forward nodes, each the only forward reader of the
value before it, and their gradient blocks (``dy`` into the product, ``db`` its contribution
to b, the two contributions to a), never by the nodes the gradient rules emitted. The fused
node takes over a's whole gradient (the gradient block of the node making a records it), or
the Cast to a's type that is its one reader: that gradient must be made from the two
contributions alone.

``fuse_swiglu`` then makes the forward one ``SwiGlu(a, b) -> (y, s)`` where nothing but the
product reads ``h = a * s`` (after ``fuse_swiglu_grad``; s stays an output, the backward reads
it): three kernels and the write and reread of s and h become one pass. s is computed as ORT's
CUDA Sigmoid writes it (``a > 0 ? 1 / (1 + exp(-|a|)) : 1 - ...``, each step in T); ORT CPU's
Sigmoid is MLAS's own approximation, so on CPU s may differ in its last bits (``same math``).

Left as they are: a Sigmoid whose input or output has other forward readers, a product that
broadcasts, values not all of one float type (float32 on CPU; float32, float16 or bfloat16 on
CUDA), a backward a policy computes partly in another precision (``match.interior``) or that
is emulated (``match.emulated``), an ``a`` whose gradient is not recorded or is read in
float32 by more than one Cast, and blocks that are missing.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir.links import GradientBlock, ancestors, gradient_blocks
from mpgraph._ir.meta import NODE_PRECISION, NODE_ROLE, PRECISION_OF_DTYPE, Precision, Role
from mpgraph.lowering.match import DOMAIN, emulated, interior, replace, swap_backward

__all__ = ["fuse_swiglu", "fuse_swiglu_grad"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _forward_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one forward node reading ``value``, when it is an ONNX ``op_type`` node."""
    if value.is_graph_output():
        return None
    nodes = {u.node for u in value.uses() if u.node.metadata_props.get(NODE_ROLE) != Role.BACKWARD}
    if len(nodes) != 1:
        return None
    (node,) = nodes
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _made_of(total: ir.Value, parts: list[ir.Value]) -> bool:
    """``total`` is computed from ``parts`` (and constants) alone: the driver's summation."""
    inside = ancestors([total]) - ancestors(parts)
    for node in inside:
        for v in node.inputs:
            if v is not None and v not in parts and v.producer() not in inside and v.const_value is None:
                return False
    return bool(inside)


def _gradient_of(a: ir.Value, blocks: dict[ir.Node, GradientBlock]) -> ir.Value | None:
    """The whole gradient of ``a`` as its producer's block records it."""
    node = a.producer()
    block = blocks.get(node) if node is not None else None
    if block is None:
        return None
    index = list(node.outputs).index(a)  # type: ignore[union-attr]
    return block.dys[index] if index < len(block.dys) else None


def _target(grad: ir.Value, dtype: ir.DataType) -> ir.Value | None:
    """The value the fused da replaces: a's gradient, or its one reader's Cast to ``dtype``."""
    if grad.dtype == dtype:
        return grad
    readers = {u.node for u in grad.uses()}
    if grad.is_graph_output() or len(readers) != 1:
        return None
    (cast,) = readers
    if cast.op_type != "Cast" or cast.domain not in ("", "ai.onnx") or cast.attributes.get_int("to", 0) != dtype.value:
        return None
    return cast.outputs[0]


def _match(sigmoid: ir.Node, blocks: dict[ir.Node, GradientBlock]) -> tuple | None:
    """``([dy, a, b, s], da_target, db)`` for a fusable SwiGLU around ``sigmoid``."""
    a, s = sigmoid.inputs[0], sigmoid.outputs[0]
    mul_h = _forward_reader(s, "Mul") if a is not None else None
    if mul_h is None or sorted(map(id, mul_h.inputs)) != sorted((id(a), id(s))) or a is s:
        return None
    if {u.node for u in a.uses() if u.node.metadata_props.get(NODE_ROLE) != Role.BACKWARD} != {sigmoid, mul_h}:
        return None
    h = mul_h.outputs[0]
    mul_y = _forward_reader(h, "Mul")
    if mul_y is None or list(mul_y.inputs).count(h) != 1 or len(mul_y.inputs) != 2:
        return None
    ih = list(mul_y.inputs).index(h)
    b = mul_y.inputs[1 - ih]
    blocks_of = [blocks.get(n) for n in (sigmoid, mul_h, mul_y)]
    if b is None or b in (a, s) or any(bl is None or not bl.dys or len(bl.dxs) < len(bl.node.inputs) for bl in blocks_of):
        return None
    sb, hb, yb = blocks_of  # type: ignore[misc]
    ia, i_s = list(mul_h.inputs).index(a), list(mul_h.inputs).index(s)
    dy, db, c1, c2 = yb.dys[0], yb.dxs[1 - ih], hb.dxs[ia], sb.dxs[0]
    if hb.dys[0] is not yb.dxs[ih] or sb.dys[0] is not hb.dxs[i_s]:
        return None  # h or s takes gradient from elsewhere too
    values = (dy, a, b, s, h, db, c1, c2)
    dtype = a.dtype
    if any(v is None for v in values) or dtype not in _TYPES or any(v.dtype != dtype for v in values):  # type: ignore[union-attr]
        return None
    if a.shape is None or b.shape is None or list(a.shape) != list(b.shape) or emulated(s, h, db, c1, c2):
        return None
    want = PRECISION_OF_DTYPE[dtype]
    if any(n.metadata_props.get(NODE_PRECISION, want) not in (want, Precision.NONE)
           for n in interior([db, c1, c2], [dy, a, b, s, h])):
        return None
    grad = _gradient_of(a, blocks)
    if grad is None or not _made_of(grad, [c1, c2]):  # type: ignore[list-item]
        return None
    target = _target(grad, dtype)
    return ([dy, a, b, s], target, db) if target is not None else None


def fuse_swiglu_grad(model: ir.Model) -> int:
    """Fuse the backward of every ``(a * Sigmoid(a)) * b`` in ``model``'s main graph whose
    blocks are recorded, in place; how many ``SwiGluGrad`` nodes were made."""
    graph = model.graph
    blocks = gradient_blocks(graph)
    fused = 0
    for node in list(blocks):
        if node.op_type != "Sigmoid" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
            continue
        found = _match(node, blocks)
        if found is None:
            continue
        inputs, target, db = found
        meta = dict(db.producer().metadata_props) if db.producer() is not None else {}
        new = ir.Node(DOMAIN, "SwiGluGrad", inputs, num_outputs=2, name=f"{node.name}/SwiGluGrad", metadata_props=meta)
        for out, like in zip(new.outputs, inputs[1:3]):
            out.dtype, out.shape = like.dtype, like.shape
        if swap_backward(graph, new, [target, db]):
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused


def _forward(sigmoid: ir.Node) -> tuple[ir.Node, ir.Node, ir.Value] | None:
    """``(mul_h, mul_y, b)`` when ``sigmoid``'s forward is ``y = (a * s) * b`` with h read by
    the product alone, all of one float type and shape."""
    a, s = sigmoid.inputs[0], sigmoid.outputs[0]
    mul_h = _forward_reader(s, "Mul") if a is not None else None
    if mul_h is None or sorted(map(id, mul_h.inputs)) != sorted((id(a), id(s))) or a is s:
        return None
    h = mul_h.outputs[0]
    readers = {u.node for u in h.uses()}
    if h.is_graph_output() or len(readers) != 1:
        return None
    (mul_y,) = readers
    if mul_y.op_type != "Mul" or mul_y.domain not in ("", "ai.onnx") or len(mul_y.inputs) != 2 \
            or list(mul_y.inputs).count(h) != 1:
        return None
    b = mul_y.inputs[1 - list(mul_y.inputs).index(h)]
    dtype = a.dtype  # type: ignore[union-attr]
    values = (a, b, s, h, mul_y.outputs[0])
    if b is None or b is s or dtype not in _TYPES or any(v.dtype != dtype for v in values):  # type: ignore[union-attr]
        return None
    if a.shape is None or b.shape is None or list(a.shape) != list(b.shape) or emulated(s, h, mul_y.outputs[0]):  # type: ignore[union-attr]
        return None
    want = PRECISION_OF_DTYPE[dtype]
    if any(n.metadata_props.get(NODE_PRECISION, want) not in (want, Precision.NONE) for n in (sigmoid, mul_h, mul_y)):
        return None
    return mul_h, mul_y, b


def fuse_swiglu(model: ir.Model) -> int:
    """Make every ``y = (a * Sigmoid(a)) * b`` in ``model``'s main graph whose ``a * s`` only the
    product reads one ``SwiGlu(a, b) -> (y, s)``, in place; how many were made."""
    graph = model.graph
    fused = 0
    for sigmoid in [n for n in graph if n.op_type == "Sigmoid" and n.domain in ("", "ai.onnx")]:
        found = _forward(sigmoid)
        if found is None:
            continue
        mul_h, mul_y, b = found
        a = sigmoid.inputs[0]
        node = ir.Node(DOMAIN, "SwiGlu", [a, b], num_outputs=2, name=f"{sigmoid.name}/SwiGlu",
                       metadata_props=dict(mul_y.metadata_props))
        # Before the product, which reads b (a Sigmoid may come before b is made); s has no
        # reader before it but a * s.
        replace(graph, [mul_y, mul_h, sigmoid], node, (mul_y.outputs[0], sigmoid.outputs[0]), before=mul_y)
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
