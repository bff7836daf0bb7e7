"""Fuse an attention softmax's backward into ``SoftmaxGradDot`` (a session lowering).

For ``P = Softmax(S)`` over the last axis whose one forward reader is ``O = P V`` (no
broadcasting over the leading axes), ``sum_j dP_ij P_ij = sum_d dO_id O_id``, a row sum over
the head dim instead of the keys. mpgraph's gradient rule (``autodiff.rules.norm.softmax``)
writes the backward that way under exactly these conditions::

    dS = P * (dP - ReduceSum(dO * O, [-1], keepdims=1))

(Reshapes around the Sub, and Casts where a policy sums in float32): seven kernels per
attention layer on ORT CUDA, and a float32 copy of O kept from the forward.
``SoftmaxGradDot(dP, P, dO, O)`` is one kernel, a warp per row. The rule finds the backward
by value: ``dP`` and ``dS`` from the Softmax's gradient block, ``dO`` from the block of the
node making O, never from the nodes the gradient rule emitted. The kernel sums delta in
float32 and rounds it and each step to T as the ops do; only the order of delta's sum differs
(``same math``).

Left as they are: a Softmax read by anything else in the forward (its backward is then the
general ``y * (dy - sum(dy * y))``), over another axis, with dP, P, dO, O and dS not all of
one type (float32 on CPU; float32, float16 or bfloat16 on CUDA), an emulated low-precision one
(``match.emulated``), or whose blocks are missing.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir.links import GradientBlock, gradient_blocks
from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.lowering.match import DOMAIN, emulated, same_dim, swap_backward

__all__ = ["fuse_softmax_grad"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _pv_node(softmax: ir.Node) -> ir.Node | None:
    """The forward node computing ``O = P V`` when it is P's one forward reader: a MatMul (or
    a FusedMatMul without transposes of P and without scaling) reading P first, once, with V
    of P's rank and leading dims (each row of P meets one row of dO)."""
    p = softmax.outputs[0]
    rank = len(p.shape) if p.shape is not None else 0
    axis = softmax.attributes.get_int("axis", -1)
    if rank < 2 or axis % rank != rank - 1 or p.is_graph_output():
        return None
    forward = {u.node for u in p.uses() if u.node.metadata_props.get(NODE_ROLE) != Role.BACKWARD}
    if len(forward) != 1:
        return None
    (node,) = forward
    plain = node.op_type == "MatMul" and node.domain in ("", "ai.onnx")
    fused = node.op_type == "FusedMatMul" and node.domain == "com.microsoft" and all(
        node.attributes.get_int(a, 0) == 0 for a in ("transA", "transBatchA", "transBatchB")) \
        and node.attributes.get_float("alpha", 1.0) == 1.0
    if not (plain or fused) or node.inputs[0] is not p or list(node.inputs).count(p) != 1:
        return None
    v = node.inputs[1]
    if v is None or v.shape is None or len(v.shape) != rank or not all(
            same_dim(a, b) for a, b in zip(list(p.shape)[:-2], list(v.shape)[:-2])):  # type: ignore[arg-type]
        return None
    return node


def _operands(block: GradientBlock, blocks: dict[ir.Node, GradientBlock]) -> tuple | None:
    """``([dP, P, dO, O], dS)`` for a fusable Softmax block."""
    pv = _pv_node(block.node)
    pv_block = blocks.get(pv) if pv is not None else None
    if pv is None or pv_block is None or not pv_block.dys or not block.dys or not block.dxs:
        return None
    dp, p, do, o, ds = block.dys[0], block.node.outputs[0], pv_block.dys[0], pv.outputs[0], block.dxs[0]
    values = (dp, p, do, o, ds)
    if any(v is None for v in values) or p.dtype not in _TYPES or any(v.dtype != p.dtype for v in values):  # type: ignore[union-attr]
        return None
    if emulated(p, ds):
        return None
    return [dp, p, do, o], ds


def fuse_softmax_grad(model: ir.Model) -> int:
    """Fuse every attention softmax backward in ``model``'s main graph that its gradient
    blocks record, in place; how many ``SoftmaxGradDot`` nodes were made."""
    graph = model.graph
    blocks = gradient_blocks(graph)
    fused = 0
    for node, block in blocks.items():
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
            continue
        found = _operands(block, blocks)
        if found is None:
            continue
        inputs, ds = found
        meta = dict(ds.producer().metadata_props) if ds.producer() is not None else {}
        new = ir.Node(DOMAIN, "SoftmaxGradDot", inputs, name=f"{node.name}/SoftmaxGradDot", metadata_props=meta)
        new.outputs[0].dtype, new.outputs[0].shape = ds.dtype, node.outputs[0].shape
        if swap_backward(graph, new, [ds]):
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
