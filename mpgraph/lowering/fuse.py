"""Lower a step graph onto mpgraph's fused kernels (``ai.mpgraph`` ops).

``fuse_adamw``: each tensor's AdamW update (14 ONNX ops) becomes one ``AdamWUpdate`` node.
``fuse_layernorm_grad``: each float32 LayerNormalization backward (11 nodes) becomes one
``LayerNormGrad`` node (its third output is the kernel's workspace; nothing reads it).

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

from mpgraph.lowering.match import (
    DOMAIN,
    constant,
    consts,
    initializer,
    is_scalar,
    link,
    producer,
    replace,
    same_shape,
    uses,
)

__all__ = ["DOMAIN", "fuse_adamw", "fuse_layernorm_grad"]














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










def _match_layernorm_grad(xh_node: ir.Node, forward: dict[ir.Value, ir.Node], outputs: set[ir.Value]) -> tuple | None:
    """For ``xhat = LayerNormalization(x, ones)`` (the rule's recompute), the nodes of
    ``mpgraph.autodiff.rules.norm.layer_norm``'s dx and dscale, and the fused node's inputs."""
    if len(xh_node.inputs) != 2 or len(xh_node.outputs) != 1:
        return None
    x, ones = xh_node.inputs
    xhat = xh_node.outputs[0]
    if x is None or x.dtype != ir.DataType.FLOAT or x.shape is None or len(x.shape) < 2:
        return None
    unit = constant(ones)
    if unit is None or not np.all(unit == 1):  # xhat itself, not a scaled LayerNorm
        return None
    rank = len(x.shape)
    if xh_node.attributes.get("axis") is None or xh_node.attributes["axis"].as_int() % rank != rank - 1:
        return None
    fwd = forward.get(x)
    if fwd is None or len(fwd.outputs) < 3 or fwd.attributes.get("axis", None) is None \
            or fwd.attributes["axis"].as_int() % rank != rank - 1:
        return None
    mean, inv_std = fwd.outputs[1], fwd.outputs[2]
    # Nothing read the forward's Mean before: a pass may have dropped its name and type.
    if inv_std.dtype != ir.DataType.FLOAT or mean.dtype not in (ir.DataType.FLOAT, None):
        return None
    readers = uses(xhat, outputs)
    if readers is None or len(readers) != 3 or any(n.op_type != "Mul" for n in readers):
        return None
    # Mul_1 = Mul(dxhat, xhat), Mul_2 = Mul(xhat, m2), Mul_4 = Mul(dy, xhat)
    mul2 = [n for n in readers if n.inputs[0] is xhat]
    others = [n for n in readers if n.inputs[1] is xhat]
    if len(mul2) != 1 or len(others) != 2:
        return None
    mul2 = mul2[0]
    dxhat_mul = next((n for n in others if producer(n.inputs[0], "Mul") is not None
                      and n.inputs[0].producer().inputs[1] is fwd.inputs[1]), None)  # type: ignore[union-attr]
    if dxhat_mul is None:
        return None
    mul4 = next(n for n in others if n is not dxhat_mul)
    dxhat = dxhat_mul.inputs[0]
    scale_mul = dxhat.producer()
    assert scale_mul is not None
    dy, scale = scale_mul.inputs
    if mul4.inputs[0] is not dy or dy is None or dy.dtype != ir.DataType.FLOAT:
        return None
    dx_nodes = _match_layernorm_dx(dxhat, dxhat_mul, mul2, inv_std, rank, outputs)
    dscale_nodes = _match_layernorm_dscale(mul4, rank, outputs)
    if dx_nodes is None or dscale_nodes is None:
        return None
    if scale is None or scale.shape is None or len(scale.shape) != 1 or scale.dtype != ir.DataType.FLOAT:
        return None
    if scale_mul.outputs[0] in outputs:
        return None
    chain = [xh_node, scale_mul, dxhat_mul, mul2, mul4, *dx_nodes, *dscale_nodes]
    return [dy, x, scale, mean, inv_std], chain, dx_nodes[-1].outputs[0], dscale_nodes[-1].outputs[0]


def _match_layernorm_dx(dxhat: ir.Value, dxhat_mul: ir.Node, mul2: ir.Node, inv_std: ir.Value, rank: int,
                        outputs: set[ir.Value]) -> list[ir.Node] | None:
    """``m1 = ReduceMean(dxhat)``, ``m2 = ReduceMean(dxhat * xhat)`` over the last axis, and
    ``dx = Mul(inv_std, Sub(Sub(dxhat, m1), Mul(xhat, m2)))``: those nodes, ``dx``'s last."""
    # m1 = ReduceMean(dxhat, [-1]); Sub(dxhat, m1); m2 = ReduceMean(Mul_1, [-1])
    dxhat_readers = uses(dxhat, outputs)
    if dxhat_readers is None or len(dxhat_readers) != 3:
        return None
    rmean1 = next((n for n in dxhat_readers if n.op_type == "ReduceMean"), None)
    sub0 = next((n for n in dxhat_readers if n.op_type == "Sub" and n.inputs[0] is dxhat), None)
    if rmean1 is None or sub0 is None or sub0.inputs[1] is not rmean1.outputs[0]:
        return None
    t = dxhat_mul.outputs[0]
    t_readers = uses(t, outputs)
    if t_readers is None or len(t_readers) != 1 or t_readers[0].op_type != "ReduceMean":
        return None
    rmean2 = t_readers[0]
    last = [rank - 1]
    for reduce in (rmean1, rmean2):
        axes = consts(reduce.inputs[1]) if len(reduce.inputs) > 1 else None
        keep = reduce.attributes.get("keepdims")
        if axes is None or [a % rank for a in axes] != last or (keep is not None and keep.as_int() != 1):
            return None
        if uses(reduce.outputs[0], outputs) is None or len(reduce.outputs[0].uses()) != 1:
            return None
    if mul2.inputs[1] is not rmean2.outputs[0]:
        return None
    # Sub_1 = Sub(Sub, Mul_2); dx = Mul(inv_std, Sub_1)
    sub1 = [u.node for u in sub0.outputs[0].uses()]
    if len(sub1) != 1 or sub1[0].op_type != "Sub" or sub1[0].inputs[1] is not mul2.outputs[0] or sub0.outputs[0] in outputs:
        return None
    sub1 = sub1[0]
    if len(mul2.outputs[0].uses()) != 1 or mul2.outputs[0] in outputs:
        return None
    dx_mul = [u.node for u in sub1.outputs[0].uses()]
    if len(dx_mul) != 1 or dx_mul[0].op_type != "Mul" or dx_mul[0].inputs[0] is not inv_std or sub1.outputs[0] in outputs:
        return None
    return [rmean1, rmean2, sub0, sub1, dx_mul[0]]


def _match_layernorm_dscale(mul4: ir.Node, rank: int, outputs: set[ir.Value]) -> list[ir.Node] | None:
    """``dscale = ReduceSum(Mul(dy, xhat), leading axes, keepdims=0)``: the ReduceSum."""
    # dscale = ReduceSum(Mul(dy, xhat), leading axes, keepdims=0), shaped like scale
    m4_readers = uses(mul4.outputs[0], outputs)
    if m4_readers is None or len(m4_readers) != 1 or m4_readers[0].op_type != "ReduceSum":
        return None
    return [m4_readers[0]] if _sums_leading_axes(m4_readers[0], rank) else None


def _sums_leading_axes(node: ir.Node, rank: int) -> bool:
    """``node`` is ``ReduceSum(v, all axes but the last, keepdims=0)``."""
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx"):
        return False
    axes = consts(node.inputs[1]) if len(node.inputs) > 1 else None
    keep = node.attributes.get("keepdims")
    return axes is not None and sorted(a % rank for a in axes) == list(range(rank - 1)) and keep is not None and keep.as_int() == 0


def _bias_grad(dy: ir.Value, chain: list[ir.Node], rank: int, outputs: set[ir.Value]) -> tuple | None:
    """``dbias = ReduceSum(dy, leading axes, keepdims=0)`` when the chain and it are dy's only
    readers: ``(reduce, dy to read, cast to drop or None)``; a float16/bfloat16 ``dy`` cast to
    float32 just for these readers is read as it is (the kernel converts on load)."""
    members = {id(n) for n in chain}
    others = list({id(u.node): u.node for u in dy.uses() if id(u.node) not in members}.values())
    if len(others) != 1 or not _sums_leading_axes(others[0], rank) or dy in outputs or others[0].inputs[0] is not dy:
        return None
    reduce = others[0]
    cast = producer(dy, "Cast")
    low = cast.inputs[0] if cast is not None else None
    if low is not None and low.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return reduce, low, cast
    return reduce, dy, None


def fuse_layernorm_grad(model: ir.Model) -> int:
    """Fuse every matching float32 LayerNormalization backward (over the last axis) in
    ``model``'s main graph, in place; how many became ``LayerNormGrad`` nodes (or
    ``LayerNormGradBias``, which also makes the bias gradient ``ReduceSum(dy)`` and reads a
    float16/bfloat16 ``dy`` before its cast)."""
    graph = model.graph
    outputs = set(graph.outputs)
    forward: dict[ir.Value, ir.Node] = {}
    for node in graph:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and len(node.outputs) >= 3 \
                and node.inputs[0] is not None:
            forward.setdefault(node.inputs[0], node)
    fused = 0
    for node in [n for n in graph if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")]:
        if node.graph is None or forward.get(node.inputs[0]) is node:
            continue
        found = _match_layernorm_grad(node, forward, outputs)
        if found is None:
            continue
        inputs, chain, dx, dscale = found
        mean = inputs[3]
        if not mean.name:  # an unnamed output is an absent one to ORT
            mean.name = f"{chain[0].name}/mean"
        if mean.dtype is None:
            mean.type, mean.shape = ir.TensorType(ir.DataType.FLOAT), inputs[4].shape
        bias = _bias_grad(inputs[0], chain, len(inputs[1].shape), outputs)
        olds: tuple[ir.Value, ...] = (dx, dscale)
        if bias is not None:
            reduce, inputs[0], cast = bias
            chain += [reduce] + ([cast] if cast is not None else [])
            olds = (dx, dscale, reduce.outputs[0])
        op = "LayerNormGradBias" if bias is not None else "LayerNormGrad"
        new = ir.Node(DOMAIN, op, inputs, num_outputs=len(olds) + 1, name=f"{node.name}/{op}",
                      metadata_props=dict(node.metadata_props))
        # The last output is the kernel's workspace (the column sums' partials): nothing reads it.
        new.outputs[-1].name = f"{node.name}/{op}/workspace"
        new.outputs[-1].type = ir.TensorType(ir.DataType.FLOAT)
        # Before the chain's first node: every input is computed by then (dy is read by the
        # chain's Mul(dy, scale)), and every reader of dx and dscale comes later.
        members = set(map(id, chain))
        replace(graph, chain, new, olds, before=next(n for n in graph if id(n) in members))
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
