"""Fuse the backward of an ``RMSNormalization`` into ``RmsNormGrad`` (a session lowering).

Training graphs carry RMSNorm as the standard op ``RMSNormalization`` (opset 23; the dynamo
exporter writes it, ``CanonicalizeOpsPass`` rewrites the torchscript exporter's
``x * 1/sqrt(mean(x^2) + eps) * scale`` into it before differentiating). A low-precision policy
keeps it float32 (deny list: a sum of squares). Its gradient rule (``autodiff.rules.norm.rms_norm``)
recomputes ``r`` and differentiates::

    r = Reciprocal(Sqrt(Add(ReduceMean(Mul(x, x)), eps)));  xhat = Mul(x, r);  dxhat = Mul(dy, scale)
    dx = Mul(r, Sub(dxhat, Mul(xhat, ReduceMean(Mul(dxhat, xhat)))))
    dscale = ReduceSum(Mul(dy, xhat)) over the leading axes

thirteen kernels on ORT CUDA over the residual stream (a Llama-style 125M: ``[8, 1024, 768]``
float32, 25 norms a step). Before them, the driver's sum of the norm output's gradients: under
a bf16 policy the q, k and v (or gate and up) projections' bfloat16 input gradients, each cast
to float32, then a float32 ``Sum``: four more kernels, or three.
``RmsNormGrad(x, scale, eps, dy...) -> (dx, dscale, workspace)`` reads those parts as they are
(widening a float16 or bfloat16 part on load is what its Cast did, exactly) and adds them in
the Sum's order. On CUDA a [N, D <= 768] float32 x (D a multiple of 8) takes one pass: a warp
a row kept in registers makes r, the row mean and dx and adds its rows' dy * xhat into dscale
partials, summed by a second small kernel in a fixed order (other shapes: a row kernel, then a
column kernel for the partials). The rule finds the backward
by value (the node's gradient block: ``dy`` into its output, ``dx`` and ``dscale`` its
contributions), never by the nodes the rule emitted; dy's parts are the inputs of the ``Sum``
making it (2 to 4 of them), else dy itself (a bfloat16 one too: the final norm's, read by the
float32 rule through a Cast). The kernel computes the rule's terms, summed in another order
(``same math``). The Sum and Casts go where nothing else reads them. Where dx's one reader is a
two-input ``Sum`` (or ``Add``) with a float32 value of x's shape, the residual stream's
gradient, ``RmsNormGradAdd(x, scale, eps, addend, dy...)`` writes that sum instead (the same
bits: two terms add the same in either order), and the Sum goes.

The forward stays ORT's: ``RMSNormalization`` has a CUDA kernel from opset 23 (float, float16,
bfloat16; ORT's LayerNorm kernel in its simplified form), one kernel already.

Left as they are: an RMSNormalization not over the last axis alone, with another type than
float32 for x, scale or a contribution (the policies keep norms float32; the CUDA code is
templated on x's type but only float32 is registered), a dy that is not float32, float16 or
bfloat16, a 1-D x, a scale that is not ``[D]``, a backward a policy
computes partly in another precision (``match.interior``) or that is emulated
(``match.emulated``), and one without a recorded backward.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.links import GradientBlock
from mpgraph._ir.meta import NODE_PRECISION, Precision
from mpgraph._ir.names import NameScope
from mpgraph.lowering.match import (
    DOMAIN,
    emulated,
    interior,
    op_blocks,
    scalar_constant,
    swap_backward,
)

__all__ = ["fuse_rmsnorm_grad"]

FLOAT = ir.DataType.FLOAT
_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: The most parts of dy the kernel adds (Llama's q, k and v projections: three).
MAX_PARTS = 4


def _operands(block: GradientBlock) -> tuple | None:
    """``(dy, x, scale, [dx, dscale])`` of a fusable RMSNormalization block; else ``None``."""
    node = block.node
    if len(node.inputs) != 2 or not block.dys or block.dys[0] is None:
        return None
    x, scale, dy = node.inputs[0], node.inputs[1], block.dys[0]
    if x is None or scale is None or x.shape is None or len(x.shape) < 2:
        return None
    rank, cols = len(x.shape), x.shape[-1]
    if node.attributes.get_int("axis", -1) % rank != rank - 1:
        return None
    shape = scale.shape
    if shape is None or len(shape) != 1 or not isinstance(shape[0], int) or (isinstance(cols, int) and shape[0] != cols):
        return None
    grads = [*block.dxs[:2], *[None] * (2 - len(block.dxs[:2]))]
    if all(g is None for g in grads) or any(v.dtype != FLOAT for v in (x, scale, *grads) if v is not None):
        return None
    if dy.dtype not in (FLOAT, *_LOW):
        return None
    if emulated(node.outputs[0], *grads):
        return None
    sources = [dy, x, scale, *node.outputs]
    if any(n.metadata_props.get(NODE_PRECISION, Precision.FLOAT32) not in (Precision.FLOAT32, Precision.NONE)
           for n in interior(grads, sources)):
        return None
    return dy, x, scale, grads


def _parts(dy: ir.Value, x: ir.Value) -> list[ir.Value]:
    """The values the graph sums into ``dy`` (a ``Sum``'s 2 to 4 inputs of x's shape, as far as
    it is known), each read before its widening Cast to float32; else ``[dy]``."""
    node = dy.producer()
    if node is None or node.op_type != "Sum" or node.domain not in ("", "ai.onnx") or not 2 <= len(node.inputs) <= MAX_PARTS:
        return [dy]
    parts = list(node.inputs)
    if any(p is None or p.dtype not in (FLOAT, *_LOW) or not _same_shape(p, x) for p in parts):
        return [dy]
    return [_unwidened(p) for p in parts]  # type: ignore[arg-type]


def _same_shape(value: ir.Value, x: ir.Value) -> bool:
    """``value`` has x's shape wherever both know a dim (the kernel checks the sizes again)."""
    if value.shape is None or x.shape is None:
        return value.shape is None
    return len(value.shape) == len(x.shape) and all(
        not isinstance(a, int) or not isinstance(b, int) or a == b for a, b in zip(value.shape, x.shape))


def _unwidened(value: ir.Value) -> ir.Value:
    """The float16 or bfloat16 value a Cast to float32 made ``value`` from (the kernel widens it
    on load, exactly as the Cast); else ``value``."""
    node = value.producer()
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or value.dtype != FLOAT:
        return value
    source = node.inputs[0]
    return source if source is not None and source.dtype in _LOW else value


def _residual_sum(dx: ir.Value | None, x: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """``(addend, total)`` when dx's one reader is ``total = Sum(dx, addend)`` or ``Add`` (either
    order), ``addend`` float32 of x's shape as far as it is known; else ``None``."""
    if dx is None or dx.is_graph_output():
        return None
    readers = {u.node for u in dx.uses()}
    if len(readers) != 1:
        return None
    (node,) = readers
    if node.op_type not in ("Sum", "Add") or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    others = [v for v in node.inputs if v is not dx]
    if len(others) != 1 or others[0] is None or others[0].dtype != FLOAT or not _same_shape(others[0], x):
        return None
    if not _same_shape(node.outputs[0], x):
        return None  # a broadcasting Add
    return others[0], node.outputs[0]


def fuse_rmsnorm_grad(model: ir.Model) -> int:
    """Fuse the backward of every float32 ``RMSNormalization`` over the last axis in ``model``'s
    main graph that records one, in place; how many ``RmsNormGrad`` nodes were made."""
    graph = model.graph
    names = NameScope(graph)
    fused = 0
    for node, block in op_blocks(graph, "RMSNormalization"):
        found = _operands(block)
        if found is None:
            continue
        dy, x, scale, grads = found
        eps = node.attributes.get_float("epsilon", 1e-5)
        eps_value = scalar_constant(graph, f"ai.mpgraph/rmsnorm/eps_{float(np.float32(eps)):.8g}", np.float32(eps), FLOAT)
        first = next(g for g in grads if g is not None)
        meta = dict(first.producer().metadata_props) if first.producer() is not None else {}
        parts = _parts(dy, x)
        residual = _residual_sum(grads[0], x)
        if residual is not None and _swap(graph, names, node, "RmsNormGradAdd", [x, scale, eps_value, residual[0], *parts],
                                          [residual[1], grads[1]], meta):
            fused += 1
        elif _swap(graph, names, node, "RmsNormGrad", [x, scale, eps_value, *parts], grads, meta):
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused


def _swap(graph: ir.Graph, names: NameScope, node: ir.Node, op: str, inputs: list[ir.Value],
          olds: list[ir.Value | None], meta: dict[str, str]) -> bool:
    """Put an ``op`` node computing ``olds`` (dx or dx + addend, dscale) in their place."""
    x, scale = inputs[0], inputs[1]
    new = ir.Node(DOMAIN, op, inputs, num_outputs=3, name=names.fresh(f"{node.name}/{op}"), metadata_props=meta)
    for out, shape in zip(new.outputs, (x.shape, scale.shape, None)):
        out.type, out.shape = ir.TensorType(FLOAT), shape
    new.outputs[2].name = f"{new.name}/workspace"
    return swap_backward(graph, new, olds)
