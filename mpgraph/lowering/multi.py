"""Batch per-tensor work into mpgraph's multi-tensor ops (a session lowering).

A step graph does some work once per parameter tensor: its optimizer update, the cast of its
float32 master weight to the compute dtype, and under loss scaling the unscale and finite
check of its gradient. On ORT CUDA each is a kernel launch per tensor (a hundred tensors: a
hundred launches of microseconds each). The multi-tensor ops do all of them in one launch per
32 tensors, as Apex's and PyTorch's ``foreach`` kernels do:

- ``batch_adamw``: ``AdamWUpdate`` nodes (``fuse_adamw`` made them) that read the same seven
  scalars become one ``MultiAdamWUpdate``; bit-identical, the same arithmetic.
- ``batch_casts``: float32 ``Cast`` nodes to bfloat16 or float16 whose input is a graph input
  (the master weights) become one ``CastToBFloat16``/``CastToFloat16``; bit-identical.
- ``fuse_unscale``: the loss scaling pass's unscale and check (per gradient: a ``Cast`` to
  float, ``Mul`` by the inverse scale, ``ReduceSum``, an ``Add`` into the total, and the
  ``Where`` that zeroes it on overflow; then ``IsNaN(total * 0)``, found from the loss-scale
  state's ``found_inf`` output that the step contract records) becomes one
  ``UnscaleGradients``. The unscaled gradients are bit-identical; ``found_inf`` is "some entry
  is not finite", as PyTorch's ``GradScaler`` defines it. The ONNX form also reports
  overflow when a finite gradient's float32 sum overflows (entries near 1e38), which no
  float16 gradient times an inverse scale of at most one can reach.
"""

from __future__ import annotations

from collections import defaultdict

import onnx_ir as ir

from mpgraph._ir.contract import LossScaleState
from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import DOMAIN, constant, hand_over

__all__ = ["batch_adamw", "batch_casts", "fuse_unscale"]

_ONNX = ("", "ai.onnx")


def _plain(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in _ONNX


def batch_adamw(model: ir.Model) -> int:
    """Merge ``AdamWUpdate`` nodes that share their scalars into ``MultiAdamWUpdate`` nodes;
    how many nodes were merged away."""
    graph = model.graph
    groups: dict[tuple[int, ...], list[ir.Node]] = defaultdict(list)
    for node in graph:
        if node.op_type == "AdamWUpdate" and node.domain == DOMAIN:
            groups[tuple(id(v) for v in node.inputs[4:])].append(node)
    merged = 0
    names: NameScope | None = None
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        names = names or NameScope(graph)
        inputs = [*nodes[0].inputs[4:]] + [v for n in nodes for v in n.inputs[:4]]
        multi = Rewrite(graph, nodes[0].name or "adamw", names=names).node(
            "MultiAdamWUpdate", *inputs, name="multi", domain=DOMAIN, num_outputs=3 * len(nodes), like=nodes[-1])
        graph.insert_after(nodes[-1], multi)
        hand_over([o for n in nodes for o in n.outputs], list(multi.outputs))
        graph.remove(nodes, safe=True)
        merged += len(nodes) - 1
    if merged:
        graph.sort()  # readers of the earlier nodes' outputs (a packed slot's Split) may precede it
    return merged


def batch_casts(model: ir.Model) -> int:
    """Merge the float32 casts of graph inputs to bfloat16 (and to float16) into one node
    each; how many nodes were merged away."""
    graph = model.graph
    ops = {ir.DataType.BFLOAT16: "CastToBFloat16", ir.DataType.FLOAT16: "CastToFloat16"}
    groups: dict[ir.DataType, list[ir.Node]] = defaultdict(list)
    for node in graph:
        x = node.inputs[0] if node.inputs else None
        if not _plain(node, "Cast") or x is None or x.dtype != ir.DataType.FLOAT or x.producer() is not None:
            continue
        to = ir.DataType(node.attributes["to"].as_int())
        if to in ops:
            groups[to].append(node)
    merged = 0
    rw: Rewrite | None = None
    for to, nodes in groups.items():
        if len(nodes) < 2:
            continue
        rw = rw or Rewrite(graph, DOMAIN)
        multi = rw.node(ops[to], *(n.inputs[0] for n in nodes), name=ops[to], domain=DOMAIN, num_outputs=len(nodes),
                        like=nodes[0])
        graph.insert_before(nodes[0], multi)
        hand_over([n.outputs[0] for n in nodes], list(multi.outputs))
        graph.remove(nodes, safe=True)
        merged += len(nodes) - 1
    if merged:
        graph.sort()  # the merged node sits before the first cast; later casts' readers follow it
    return merged


def _is_zero(value: ir.Value | None) -> bool:
    array = constant(value)
    return array is not None and array.size == 1 and float(array.reshape(-1)[0]) == 0.0


def _sum_terms(total: ir.Value) -> tuple[list[ir.Node], list[ir.Node]] | None:
    """The ``ReduceSum`` probes an ``Add`` chain sums (in order) and the chain's ``Add``s."""
    probes: list[ir.Node] = []
    adds: list[ir.Node] = []
    value = total
    while _plain(value.producer(), "Add"):
        add = value.producer()
        assert add is not None
        adds.append(add)
        value, last = add.inputs  # type: ignore[assignment]
        if last is None or not _plain(last.producer(), "ReduceSum"):
            return None
        probes.append(last.producer())  # type: ignore[arg-type]
    if not _plain(value.producer(), "ReduceSum"):
        return None
    probes.append(value.producer())  # type: ignore[arg-type]
    return probes[::-1], adds


def _match_unscale(check: ir.Node, outputs: set[ir.Value]) -> tuple | None:
    """For ``IsNaN(Mul(total, 0))``: ``(inv, grads, nodes to remove, unscaled values)``."""
    probe = check.inputs[0].producer() if check.inputs[0] is not None else None
    if not _plain(probe, "Mul") or not _is_zero(probe.inputs[1]):  # type: ignore[union-attr]
        return None
    terms = _sum_terms(probe.inputs[0])  # type: ignore[union-attr, arg-type]
    if terms is None:
        return None
    probes, adds = terms
    inv: ir.Value | None = None
    grads, nodes, unscaled = [], [check, probe, *adds, *probes], []
    for reduce in probes:
        if len(reduce.inputs) > 1 or reduce.attributes.get("keepdims") is None or reduce.attributes["keepdims"].as_int():
            return None
        mul = reduce.inputs[0].producer()  # type: ignore[union-attr]
        if not _plain(mul, "Mul") or mul.outputs[0] in outputs:  # type: ignore[union-attr]
            return None
        g32, scale = mul.inputs  # type: ignore[union-attr]
        if inv is None:
            inv = scale
        if scale is not inv or g32 is None or g32.dtype != ir.DataType.FLOAT:
            return None
        cast = g32.producer()
        grad = g32
        if _plain(cast, "Cast") and len(g32.uses()) == 1 and g32 not in outputs \
                and cast.inputs[0].dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):  # type: ignore[union-attr]
            grad = cast.inputs[0]  # type: ignore[union-attr]
            nodes.append(cast)
        grads.append(grad)
        nodes.append(mul)
        unscaled.append(mul.outputs[0])  # type: ignore[union-attr]
    if inv is None or inv.dtype != ir.DataType.FLOAT:
        return None
    return inv, grads, nodes, unscaled


def _found_inf_check(model: ir.Model) -> ir.Node | None:
    """The ``IsNaN`` that makes the contract's ``found_inf`` output (through the loss
    scaling's ``Identity``), or ``None`` without loss-scale state."""
    state = LossScaleState.read(model)
    flag = next((v for v in model.graph.outputs if state is not None and v.name == state.found_inf), None)
    node = flag.producer() if flag is not None else None
    if _plain(node, "Identity") and node.inputs[0] is not None:  # type: ignore[union-attr]
        node = node.inputs[0].producer()  # type: ignore[union-attr]
    return node if _plain(node, "IsNaN") else None


def fuse_unscale(model: ir.Model) -> int:
    """Replace the loss scaling's per-gradient unscale and finite check with one
    ``UnscaleGradients`` node; how many nodes it replaced (0: no such chain)."""
    graph = model.graph
    outputs = set(graph.outputs)
    check = _found_inf_check(model)
    found = _match_unscale(check, outputs) if check is not None else None
    if found is None:
        return 0
    inv, grads, nodes, unscaled = found
    fused = Rewrite(graph, DOMAIN).node("UnscaleGradients", inv, *grads, name="UnscaleGradients", domain=DOMAIN,
                                        num_outputs=1 + len(grads), like=check)
    graph.insert_before(check, fused)  # type: ignore[arg-type]
    flag = check.outputs[0]  # type: ignore[union-attr]
    # The loss scaling's Where(found_inf, 0, u) readers: the fused output is zeroed already.
    wheres = [use.node for u in unscaled for use in u.uses()
              if _plain(use.node, "Where") and use.idx == 2 and use.node.inputs[0] is flag
              and _is_zero(use.node.inputs[1]) and use.node.outputs[0] not in outputs]
    for where in wheres:
        where.outputs[0].replace_all_uses_with(where.inputs[2])
    graph.remove(wheres, safe=True)
    hand_over([flag, *unscaled], list(fused.outputs))
    graph.remove(nodes, safe=True)
    graph.sort()  # an optimizer that reads u directly (no gating) may sit before the check
    model.opset_imports.setdefault(DOMAIN, 1)
    return len(nodes) + len(wheres)
