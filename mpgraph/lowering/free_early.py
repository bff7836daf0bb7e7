"""A node order that frees memory early (``free_early``): weight gradients as soon as they can run.

ORT runs a session's nodes in the order of a reverse depth-first walk from the graph's last
nodes, visiting producers by their number in the node list (``_ir.ort_order``), and
frees a buffer after its last reader. A weight gradient ``dW = X^T dY`` is read only by the
optimizer, at the end of the step, and that walk reaches it only from there: on GPT-2 small's
capturing CUDA plan every ``dW`` GEMM ran after the whole backward, so each layer's saved input
``X``, its output gradient ``dY`` and the 786 MiB logits gradient stayed live until the
optimizer (3.1-3.4 GiB live through the backward, where they should fall).

The rule lists the nodes in another topological order, made from ORT's own:

1. A node is ready when every producer of its inputs has been listed.
2. Of the ready nodes, the first (in ORT's order) that frees at least the bytes it allocates
   is listed next: its outputs' bytes (views and graph outputs apart) are at most those of the
   buffers it is the last reader of. ``dW = Gemm(X, dY)`` allocates 4.5 MiB and frees 96.
3. When no ready node does, the ready node first in ORT's order is listed.
4. ORT does not run the list as it is but its own walk over it: the new list is kept only when
   that walk's peak of live bytes is lower than the old list's (views share their input's
   buffer; nothing else is modelled here); otherwise the graph is left as it was. (The zoo GPT's unspecialised float32 step, sizes unknown, would have run its weight
   gradients later: measured with ORT CPU's profile, which follows ``ort_order``.)

ORT's walk over the new list then runs (as ``estimate_memory`` models it) each ``dW`` right after
``dY`` exists. GPT-2 small bf16, batch 8, T 1024, the capturing CUDA plan with the library's
fused ops (``benchmarks/plan_memory.py``): first-step arena 4.53 -> 3.81 GiB (kSameAsRequested),
5.00 -> 4.00 (kNextPowerOfTwo). Sizes are the values' recorded shapes (a plan specialised to its
batch); a value of unknown size counts 0 bytes. Nothing is computed differently: the same nodes,
listed in another order.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from mpgraph._ir.ort_order import VIEW_OPS, ort_order

__all__ = ["free_early"]


def _nbytes(value: ir.Value) -> int:
    if value.dtype is None or value.shape is None or not value.shape.is_static():
        return 0
    return math.prod(value.shape.numpy()) * value.dtype.itemsize


def _owners(nodes: list[ir.Node]) -> dict[ir.Value, ir.Value]:
    """Each node output -> the value whose buffer it lives in (a view shares its input's)."""
    owner: dict[ir.Value, ir.Value] = {}
    for node in nodes:
        for value in node.outputs:
            src = node.inputs[0] if node.op_type in VIEW_OPS and node.inputs else None
            owner[value] = owner.get(src, src) if src is not None else value
    return owner


def _listing(nodes: list[ir.Node], owner: dict[ir.Value, ir.Value], held: set[ir.Value]) -> list[ir.Node]:
    """The nodes in the module's order, from ``nodes`` (ORT's)."""
    position = {node: i for i, node in enumerate(nodes)}
    reads = {node: {owner[v] for v in node.inputs if v is not None and v in owner} for node in nodes}
    remaining: dict[ir.Value, set[ir.Node]] = {}
    for node, bufs in reads.items():
        for buf in bufs:
            remaining.setdefault(buf, set()).add(node)
    allocates = {node: sum(_nbytes(v) for v in node.outputs if owner.get(v) is v and v not in held) for node in nodes}
    waiting = {node: len({v.producer() for v in node.inputs if v is not None and v.producer() is not None})
               for node in nodes}
    ready = {node for node, n in waiting.items() if n == 0}
    order: list[ir.Node] = []
    while ready:
        candidates = sorted(ready, key=position.__getitem__)
        node = next((c for c in candidates if allocates[c] <= sum(
            _nbytes(b) for b in reads[c] if b not in held and remaining[b] == {c})), candidates[0])
        ready.discard(node)
        order.append(node)
        for buf in reads[node]:
            remaining[buf].discard(node)
        for user in {use.node for v in node.outputs for use in v.uses()}:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.add(user)
    return order


def _peak(nodes: list[ir.Node], owner: dict[ir.Value, ir.Value], held: set[ir.Value]) -> int:
    """The most bytes of intermediates live at once when ORT runs ``nodes`` in this order."""
    last: dict[ir.Value, int] = {}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if v is not None and v in owner:
                last[owner[v]] = i
    freed = [0] * (len(nodes) + 1)
    live = peak = 0
    for i, node in enumerate(nodes):
        for v in node.outputs:
            if owner.get(v) is v and v not in held:
                live += _nbytes(v)
                freed[max(i, last.get(v, i))] += _nbytes(v)
        peak = max(peak, live)
        live -= freed[i]
    return peak


def _relist(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    for node in list(graph):
        graph.remove(node)
    graph.extend(nodes)


def free_early(model: ir.Model) -> int:
    """List ``model``'s nodes so that ORT frees buffers early (see the module); how many nodes
    moved in the list (0: ORT's order over the new list would not have a lower peak, and the
    list is left as it was)."""
    graph = model.graph
    before = list(graph)
    nodes = ort_order(model)
    owner = _owners(nodes)
    held = {owner[v] for v in graph.outputs if v in owner}
    order = _listing(nodes, owner, held)
    assert len(order) == len(before), "free_early: the graph has a cycle or nodes outside ORT's walk"
    _relist(graph, order)
    if _peak(ort_order(model), owner, held) >= _peak(nodes, owner, held):
        _relist(graph, before)
        return 0
    return sum(1 for a, b in zip(before, order) if a is not b)
