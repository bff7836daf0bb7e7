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

5. A small node that alone keeps a large buffer alive runs right after the buffer's other
   readers: ORT's walk reaches a node when it walks the first of its readers, the highest
   numbered first, so a bias gradient's ``ReduceSum`` read only through the optimizer's
   ``Concat`` of small gradients ran with the optimizer, holding its input, BERT's 477 MiB
   float32 logits gradient, through the whole backward. Each node that is the last reader of a
   buffer at least 16 times its own outputs' bytes, 4 nodes or more after the buffer's other
   readers, is listed right before its one reader, that
   one right before its own, and so on along single readers, so that each is the highest
   numbered reader ORT's walk meets; the move is kept only when ORT's walk over the new list
   has a lower peak (4.). BERT-base dynamo bf16, batch 8, T 512, the capturing CUDA plan
   (``benchmarks/plan_memory.py``): transient peak 2.17 -> 1.94 GiB.
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


def _holders(nodes: list[ir.Node], owner: dict[ir.Value, ir.Value], held: set[ir.Value]) -> list[ir.Node]:
    """The nodes that are the last reader, in ``nodes``' order, of a buffer 16 times the bytes
    they make and that run at least 4 nodes after its other readers (case 5), in that order."""
    reads: dict[ir.Value, list[int]] = {}
    for i, node in enumerate(nodes):
        for b in {owner[v] for v in node.inputs if v is not None and v in owner}:
            reads.setdefault(b, []).append(i)
    made = {v: i for i, node in enumerate(nodes) for v in node.outputs}
    out = []
    for i, node in enumerate(nodes):
        makes = sum(_nbytes(v) for v in node.outputs if owner.get(v) is v and v not in held)
        for b in {owner[v] for v in node.inputs if v is not None and v in owner} - held:
            before = [k for k in reads[b] if k != i]
            if reads[b][-1] == i and _nbytes(b) >= 16 * max(makes, 1) and i - max(before, default=made.get(b, i)) >= 4:
                out.append(node)
                break
    return out


def _reader_chain(node: ir.Node) -> list[tuple[ir.Node, ir.Node]]:
    """(node, its one reader) pairs along single readers from ``node``."""
    chain = []
    while True:
        readers = {u.node for v in node.outputs for u in v.uses()}
        if len(readers) != 1 or any(v.is_graph_output() for v in node.outputs):
            return chain
        (reader,) = readers
        chain.append((node, reader))
        node = reader


def _read_soon(model: ir.Model, owner: dict[ir.Value, ir.Value], held: set[ir.Value]) -> int:
    """Case 5: list each holder right before its reader (and so on), where that lowers ORT's
    walk's peak; how many holders moved."""
    graph, moved = model.graph, 0
    nodes = ort_order(model)
    peak = _peak(nodes, owner, held)
    for holder in _holders(nodes, owner, held):
        chain = _reader_chain(holder)
        if not chain:
            continue
        undo = []
        for node, reader in reversed(chain):  # the last pair first: each reader is in place
            listed = list(graph)
            undo.append((node, listed[listed.index(node) + 1]))  # a reader follows each node
            graph.remove(node)
            graph.insert_before(reader, node)
        new = _peak(ort_order(model), owner, held)
        if new < peak:
            peak, moved = new, moved + 1
            continue
        for node, following in reversed(undo):  # each move undone, the last first
            graph.remove(node)
            graph.insert_before(following, node)
    return moved


def free_early(model: ir.Model) -> int:
    """List ``model``'s nodes so that ORT frees buffers early (see the module); how many nodes
    moved in the list (0: ORT's order over the new list would not have a lower peak, and the
    list is left as it was) plus how many holders (case 5) moved."""
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
        listed = 0
    else:
        listed = sum(1 for a, b in zip(before, order) if a is not b)
    return listed + _read_soon(model, owner, held)
