"""``Rewrite``: the nodes and constants a lowering rule puts in a matched node's place.

The ``Builder``'s counterpart for rewrites of a finished graph. Every node a rule makes gets

1. **a deterministic name** from the one allocator (``names.NameScope``): ``<scope>/<name>``,
   the scope being the matched node's name (``relu1/indices``), its outputs ``<node>`` or, for
   several, ``<node>:<i>``; a constant ``<scope>/<name>`` too. A taken name gets ``_1``,
   ``_2``..., so a rule run twice, or two rules with the same idea, never collide;
2. **metadata only where it stands for a matched node**: ``like=node`` copies that node's
   (role, precision, gradient links), so the audit of a session graph still finds them; the
   helper nodes around it (shape arithmetic, reorders) carry none;
3. **no guessed dtype**: a rule's custom ops have no schema here; a rule types what a later
   rule reads itself.

Nothing is appended: ``nodes`` lists what was made, in order, for the rule to place where
the matched node was (``graph.insert_before``), since a rewrite's readers are already there.

Example:
    >>> import numpy as np
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    >>> relu = ir.node("Relu", [x], name="relu1", metadata_props={"mpgraph.role": "forward"})
    >>> graph = ir.Graph([x], relu.outputs, nodes=[relu])
    >>> rw = Rewrite(graph, relu.name)
    >>> flat = rw.node("Reshape", x, rw.constant("shape", np.array([-1], np.int64)), name="flat")
    >>> fused = rw.node("Relu", flat.outputs[0], name="Relu", domain="ai.mpgraph", like=relu)
    >>> [(n.name, n.outputs[0].name, dict(n.metadata_props)) for n in rw.nodes]
    [('relu1/flat', 'relu1/flat', {}), ('relu1/Relu', 'relu1/Relu', {'mpgraph.role': 'forward'})]
    >>> sorted(graph.initializers)
    ['relu1/shape']
    >>> rw.node("Reshape", x, rw.constant("shape", np.array([-1], np.int64)), name="flat").name  # taken: a suffix
    'relu1/flat_1'
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope

__all__ = ["Rewrite"]


class Rewrite:
    """Makes the nodes and constants that replace a matched node of ``graph``.

    Args:
        graph: The graph the rewrite is for (constants are registered in it at once).
        scope: First part of every name: the matched node's name (``<node>/as_conv``...).
        names: The allocator to share with the rule's other rewrites of the graph (one
            ``NameScope`` reads the whole graph); a new one over ``graph`` by default.
    """

    def __init__(self, graph: ir.Graph, scope: str, *, names: NameScope | None = None) -> None:
        self.graph = graph
        self.scope = scope
        self.names = names if names is not None else NameScope(graph)
        self.nodes: list[ir.Node] = []

    def node(self, op_type: str, *inputs: ir.Value | None, name: str, domain: str = "", num_outputs: int = 1,
             like: ir.Node | None = None, **attrs: Any) -> ir.Node:
        """A node ``<scope>/<name>``, not yet in the graph (listed in ``nodes``).

        Args:
            domain: The op's domain (``""``: ONNX).
            like: The matched node this one stands for: its metadata is copied.
            attrs: Python values or ``ir.Attr`` (``None`` ones are left out).
        """
        node_name = self.names.fresh(f"{self.scope}/{name}")
        node = ir.node(op_type, list(inputs), {k: v for k, v in attrs.items() if v is not None}, domain=domain,
                       num_outputs=num_outputs, name=node_name,
                       metadata_props=dict(like.metadata_props) if like is not None else None)
        for i, out in enumerate(node.outputs):
            out.name = node_name if num_outputs == 1 else self.names.fresh(f"{node_name}:{i}")
        self.nodes.append(node)
        return node

    def constant(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer ``<scope>/<name>`` holding ``array``, registered in the graph."""
        full = self.names.fresh(f"{self.scope}/{name}")
        value = ir.Value(name=full, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         shape=ir.Shape(list(array.shape)), const_value=ir.tensor(array))
        self.graph.register_initializer(value)
        return value
