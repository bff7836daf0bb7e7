"""The order ONNX Runtime runs a graph's nodes in, and the ops whose output is a view of their input.

The memory estimate (``audit.memory``) walks a graph in this order, and the lowering's
``free_early`` lists nodes so that this order frees buffers early.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["VIEW_OPS", "ort_order"]

#: Ops whose output shares its input's buffer in ORT (no new allocation).
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def ort_order(model: ir.Model) -> list[ir.Node]:
    """The nodes in the order ORT's default execution plan runs them.

    ORT numbers nodes as the file lists them and sorts topologically by a reverse depth-first
    walk: from the nodes no node consumes (the last one first), a node is emitted after its
    producers, visiting the producer with the highest number first (``GraphViewer`` with
    ``ExecutionOrder::DEFAULT``). ORT's graph optimizations then fuse some nodes, which this
    order does not follow.
    """
    nodes = list(model.graph)
    index = {id(n): i for i, n in enumerate(nodes)}
    consumed = {id(v.producer()) for n in nodes for v in n.inputs if v is not None and v.producer() is not None}
    stack: list[tuple[ir.Node, bool]] = [(n, False) for n in nodes if id(n) not in consumed]
    visited: set[int] = set()
    order: list[ir.Node] = []
    while stack:
        node, leave = stack.pop()
        if leave:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        producers = {id(p): p for v in node.inputs if v is not None and (p := v.producer()) is not None}
        stack.extend((p, False) for p in sorted(producers.values(), key=lambda p: index[id(p)])
                     if id(p) not in visited)
    return order
