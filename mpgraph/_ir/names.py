"""The one name allocator: deterministic, collision-free names for what mpgraph adds to a graph.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x")
    >>> names = NameScope(ir.Graph([x], [], nodes=[]))
    >>> names.fresh("x"), names.fresh("x"), names.fresh("cast/x_bf16")
    ('x_1', 'x_2', 'cast/x_bf16')
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["NameScope"]


class NameScope:
    """Every value and node name of a graph (subgraphs included), handing out fresh ones.

    ``fresh("cast/x_bf16")`` returns the name itself when unused, else ``cast/x_bf16_1``,
    ``cast/x_bf16_2``... so re-running a pass never collides with names it made before.
    The names are those present when the scope is made plus those it handed out: two scopes
    over one graph do not see each other's names.

    Args:
        graph: The graph (or a model: its main graph) whose names are taken.
    """

    def __init__(self, graph: ir.Graph | ir.Model) -> None:
        if isinstance(graph, ir.Model):
            graph = graph.graph
        self._used: set[str] = set()
        # The next suffix to try per base: the names handed out are never freed, so every
        # smaller suffix is still taken (the same names as probing from 1, in linear time).
        self._next: dict[str, int] = {}
        for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
            if value.name:
                self._used.add(value.name)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.name:
                self._used.add(node.name)
            for maybe in (*node.inputs, *node.outputs):
                if maybe is not None and maybe.name:
                    self._used.add(maybe.name)

    def fresh(self, base: str) -> str:
        """``base``, or ``base_<k>`` with the smallest ``k >= 1`` not taken; now taken."""
        name, i = base, self._next.get(base, 0)
        if i:
            name = f"{base}_{i}"
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._next[base] = i + 1
        self._used.add(name)
        return name
