"""Lower a step graph onto mpgraph's fused kernels (``ai.mpgraph`` ops).

``fuse_adamw``: each tensor's AdamW update (14 ONNX ops) becomes one ``AdamWUpdate`` node.
``fuse_layernorm_grad``: each float32 ``LayerNormalization``'s backward becomes one
``LayerNormGrad`` node, found by value (the node's gradient block), not by the nodes its
gradient rule emitted.

``mpgraph.optim.adam`` writes one tensor's update as::

    m' = Add(m, Mul(Sub(g, m), c1))
    v' = Add(Mul(v, b2), Mul(Mul(g, g), c2))
    p' = Sub(p_decayed, Mul(Div(m', Add(Div(Sqrt(v'), bc2_sqrt), eps)), step_size))
    p_decayed = Mul(p, decay)   # AdamW; plain Adam reads p itself

where the seven coefficients are scalars. The fused node reads p, g, m, v and the scalars once
and writes p', m', v' (a missing ``decay`` becomes the constant 1, which changes no bit). The
match is exact: every intermediate must have its one reader inside the chain, so nothing else
in the graph loses a value. AMSGrad (``Max`` before the ``Sqrt``) and any other variant do not
match and keep their ONNX ops.

This is a lowering for sessions that load mpgraph's kernel library (``mpgraph.lowering``); the
step graph a user saves keeps its standard ONNX ops.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.links import GradientBlock
from mpgraph._ir.names import NameScope
from mpgraph.lowering.match import (
    DOMAIN,
    cast_to,
    emulated,
    initializer,
    is_scalar,
    link,
    op_blocks,
    producer,
    replace,
    same_shape,
    swap_backward,
)

__all__ = ["DOMAIN", "fuse_adamw", "fuse_layernorm_grad"]

FLOAT = ir.DataType.FLOAT


def _match_moments(m_new: ir.Value, v_new: ir.Value, outputs: set[ir.Value]) -> tuple | None:
    """``v' = Add(Mul(v, b2), Mul(Mul(g, g), c2))`` and ``m' = Add(m, Mul(Sub(g, m), c1))``:
    ``(g, m, v, c1, b2, c2, nodes)``."""
    # v' = Add(Mul(v, b2), Mul(Mul(g, g), c2))
    add_v = producer(v_new, "Add")
    if add_v is None:
        return None
    decayed_v, fresh_v = add_v.inputs
    mul_b2, mul_c2 = link(decayed_v, "Mul", outputs), link(fresh_v, "Mul", outputs)
    if mul_b2 is None or mul_c2 is None:
        return None
    v, b2 = mul_b2.inputs
    squared, c2 = mul_c2.inputs
    square = link(squared, "Mul", outputs)
    if square is None or square.inputs[0] is not square.inputs[1]:
        return None
    g = square.inputs[0]
    # m' = Add(m, Mul(Sub(g, m), c1))
    add_m = producer(m_new, "Add")
    if add_m is None:
        return None
    m, step_m = add_m.inputs
    mul_c1 = link(step_m, "Mul", outputs)
    if mul_c1 is None:
        return None
    diff, c1 = mul_c1.inputs
    sub_m = link(diff, "Sub", outputs)
    if sub_m is None or sub_m.inputs[0] is not g or sub_m.inputs[1] is not m:
        return None
    return g, m, v, c1, b2, c2, [add_v, mul_b2, mul_c2, square, add_m, mul_c1, sub_m]


def _match(sub: ir.Node, outputs: set[ir.Value]) -> tuple[list[ir.Value], list[ir.Node], ir.Value, ir.Value] | None:
    """The fused node's inputs, the nodes it replaces, and m', v' (``None``: no match)."""
    p_decayed, update = sub.inputs
    chain: list[ir.Node] = [sub]
    mul_step = link(update, "Mul", outputs)
    if mul_step is None:
        return None
    quotient, step_size = mul_step.inputs
    div = link(quotient, "Div", outputs)
    if div is None:
        return None
    m_new, denom = div.inputs
    add_eps = link(denom, "Add", outputs)
    if add_eps is None:
        return None
    scaled, eps = add_eps.inputs
    div_bc = link(scaled, "Div", outputs)
    if div_bc is None:
        return None
    root, bc2_sqrt = div_bc.inputs
    sqrt = link(root, "Sqrt", outputs)
    if sqrt is None:
        return None
    v_new = sqrt.inputs[0]
    chain += [mul_step, div, add_eps, div_bc, sqrt]
    found = _match_moments(m_new, v_new, outputs)
    if found is None:
        return None
    g, m, v, c1, b2, c2, moment_nodes = found
    chain += moment_nodes
    # p_decayed = Mul(p, decay), or p itself
    decay: ir.Value | None = None
    p = p_decayed
    mul_decay = link(p_decayed, "Mul", outputs)
    if mul_decay is not None and is_scalar(mul_decay.inputs[1]) and same_shape(mul_decay.inputs[0], p_decayed):
        p, decay = mul_decay.inputs
        chain.append(mul_decay)
    # m' and v' are read by the chain (Div, Sqrt) and otherwise only as graph outputs (state).
    if any(use.node is not div for use in m_new.uses()) or any(use.node is not sqrt for use in v_new.uses()):
        return None
    scalars = [c1, b2, c2, bc2_sqrt, eps, step_size]
    if not all(is_scalar(s) for s in scalars) or not same_shape(p, g, m, v, m_new, v_new):
        return None
    assert p is not None and g is not None and m is not None and v is not None
    inputs = [p, g, m, v, *scalars, decay]
    return inputs, chain, m_new, v_new  # type: ignore[return-value]


def fuse_adamw(model: ir.Model) -> int:
    """Fuse every matching AdamW/Adam tensor update in ``model``'s main graph, in place.

    Returns:
        How many updates became ``AdamWUpdate`` nodes.
    """
    graph = model.graph
    outputs = set(graph.outputs)
    one: ir.Value | None = None
    fused = 0
    for sub in [n for n in graph if n.op_type == "Sub" and n.domain in ("", "ai.onnx")]:
        if sub.graph is None:  # removed as part of an earlier match
            continue
        found = _match(sub, outputs)
        if found is None:
            continue
        inputs, chain, m_new, v_new = found
        if inputs[-1] is None:
            if one is None:
                one = initializer(graph, "ai.mpgraph/one", np.array(1.0, np.float32))
            inputs[-1] = one
        node = ir.Node(DOMAIN, "AdamWUpdate", inputs, num_outputs=3, name=f"{sub.name}/AdamWUpdate",
                       metadata_props=dict(sub.metadata_props))
        replace(graph, chain, node, (sub.outputs[0], m_new, v_new), before=sub)
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused




# -- LayerNorm backward ---------------------------------------------------------------------
#
# ``LayerNormalization(x, scale[, bias])`` over the last axis, float32 (a low-precision policy
# keeps norms float32), with the Mean and InvStdDev outputs its gradient rule
# (``autodiff.rules.norm.layer_norm``) asks for. The rule writes, with ``xhat`` recomputed by a
# unit-scale LayerNorm::
#
#     dxhat = dy * scale
#     dx = inv_std * ((dxhat - mean(dxhat)) - xhat * mean(dxhat * xhat))
#     dscale = sum(dy * xhat), dbias = sum(dy)          (over the leading axes)
#
# about twelve kernels. ``LayerNormGrad(dy, x, scale, mean, inv_std) -> (dx, dscale, workspace)``
# computes the same terms in one pass over the rows (the sums in another order: ``same math``);
# ``LayerNormGradBias`` also makes dbias and reads a float16/bfloat16 dy as it is (the rule's
# ops read its exact float32 cast). The workspace output holds the kernel's column partials;
# nothing reads it.


def _layernorm_operands(block: GradientBlock) -> tuple | None:
    """``(dy, x, scale, mean, inv_std, [dx, dscale, dbias])`` of a fusable LayerNorm block."""
    node = block.node
    if len(node.inputs) < 2 or len(node.outputs) < 3 or not block.dys or block.dys[0] is None:
        return None
    x, scale = node.inputs[0], node.inputs[1]
    mean, inv_std = node.outputs[1], node.outputs[2]
    if x is None or scale is None or x.dtype != FLOAT or x.shape is None or len(x.shape) < 2:
        return None
    rank, cols = len(x.shape), x.shape[-1]
    if node.attributes.get_int("axis", -1) % rank != rank - 1 or not _is_row(scale, cols):
        return None
    # Nothing read the forward's Mean before: a pass may have dropped its name and type.
    if inv_std.dtype != FLOAT or mean.dtype not in (FLOAT, None):
        return None
    dy = block.dys[0]
    grads = [*block.dxs[:3], *[None] * (3 - len(block.dxs[:3]))]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if grads[2] is not None and (bias is None or not _is_row(bias, cols)):
        return None
    if dy.dtype not in (FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16) or (grads[0] is None and grads[1] is None):
        return None
    if any(g is not None and g.dtype != FLOAT for g in grads) or emulated(node.outputs[0], *grads):
        return None
    return dy, x, scale, mean, inv_std, grads


def _is_row(value: ir.Value, cols: object) -> bool:
    """``value`` is float32 of static shape ``[D]``, D the last axis of x (when known)."""
    shape = value.shape
    return (value.dtype == FLOAT and shape is not None and len(shape) == 1 and isinstance(shape[0], int)
            and (not isinstance(cols, int) or shape[0] == cols))


def fuse_layernorm_grad(model: ir.Model) -> int:
    """Fuse the backward of every float32 ``LayerNormalization`` over the last axis in
    ``model``'s main graph that records one, in place; how many became ``LayerNormGrad`` nodes
    (``LayerNormGradBias`` where the bias gradient is wanted too)."""
    graph = model.graph
    names = NameScope(graph)
    fused = 0
    for node, block in op_blocks(graph, "LayerNormalization"):
        found = _layernorm_operands(block)
        if found is None:
            continue
        dy, x, scale, mean, inv_std, grads = found
        if not mean.name:  # an unnamed output is an absent one to ORT
            mean.name = names.fresh(f"{node.name}/mean")
        if mean.dtype is None:
            mean.type, mean.shape = ir.TensorType(FLOAT), inv_std.shape
        first = next(g for g in grads if g is not None)
        meta = dict(first.producer().metadata_props) if first.producer() is not None else {}
        bias = grads[2] is not None
        op = "LayerNormGradBias" if bias else "LayerNormGrad"
        before: list[ir.Node] = []
        widened = producer(dy, "Cast")
        if bias and widened is not None and widened.inputs[0] is not None \
                and widened.inputs[0].dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            dy = widened.inputs[0]  # the kernel widens it on load, exactly as the Cast does
        if not bias:  # LayerNormGrad reads float32 only
            dy, cast = cast_to(dy, FLOAT, names.fresh(f"{node.name}/{op}/dy"), meta)
            before += [cast] if cast is not None else []
        new = ir.Node(DOMAIN, op, [dy, x, scale, mean, inv_std], num_outputs=4 if bias else 3,
                      name=names.fresh(f"{node.name}/{op}"), metadata_props=meta)
        for out, shape in zip(new.outputs, (x.shape, scale.shape, scale.shape, None)):
            out.type, out.shape = ir.TensorType(FLOAT), shape
        new.outputs[-1].name = f"{new.name}/workspace"
        if swap_backward(graph, new, grads if bias else grads[:2], before):
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
