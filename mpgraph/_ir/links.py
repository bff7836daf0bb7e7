"""Backward-to-forward links of a step graph, by value identity.

Every node a gradient rule emits records the forward node it was written for, as the name of
that node's first output value (``NODE_GRAD_OF_VALUE``); ``forward_twins`` resolves it through
the graph's values. Node names may change (an optimizer pass, a user's renaming tool): the
link still finds its forward node, since a value name is how the graph itself wires data.
Graphs saved before the value link existed carry only the forward node's name
(``NODE_GRAD_OF``), which is resolved by name.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))
    >>> relu = ir.node("Relu", [x], name="relu1", metadata_props={md.NODE_ROLE: "forward"})
    >>> relu.outputs[0].name = "h"
    >>> back = ir.node("Mul", [x, x], name="grad/relu1/Mul",
    ...                metadata_props={md.NODE_ROLE: "backward", md.NODE_GRAD_OF_VALUE: "h"})
    >>> relu.name = "renamed"
    >>> forward_twins([relu, back])[back].name
    'renamed'
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir

from mpgraph._ir import meta as md

__all__ = ["GradientBlock", "ancestors", "forward_twins", "gradient_blocks", "link_to"]

_FORWARD = (md.Role.FORWARD, md.Role.LOSS)


def link_to(forward: ir.Node) -> dict[str, str]:
    """The metadata a backward node emitted for ``forward`` carries: the value link, and the
    node's name for people reading the graph (Netron)."""
    props = {}
    if forward.name:
        props[md.NODE_GRAD_OF] = forward.name
    named = next((v.name for v in forward.outputs if v.name), None)
    if named is not None:
        props[md.NODE_GRAD_OF_VALUE] = named
    return props


def forward_twins(nodes: Iterable[ir.Node]) -> dict[ir.Node, ir.Node]:
    """Each backward node that records a link -> the forward (or loss) node it leads to.

    A node with a value link is resolved by it alone (a stale node name never misleads);
    one without, by the forward node's name.
    """
    nodes = list(nodes)
    forward = [n for n in nodes if n.metadata_props.get(md.NODE_ROLE, md.Role.FORWARD) in _FORWARD]
    by_value = {v.name: n for n in forward for v in n.outputs if v.name}
    by_name = {n.name: n for n in forward if n.name}
    twins: dict[ir.Node, ir.Node] = {}
    for node in nodes:
        props = node.metadata_props
        if md.NODE_GRAD_OF_VALUE in props:
            twin = by_value.get(props[md.NODE_GRAD_OF_VALUE])
        else:
            twin = by_name.get(props.get(md.NODE_GRAD_OF, ""))
        if twin is not None and twin is not node:
            twins[node] = twin
    return twins


def ancestors(values: Iterable[ir.Value]) -> set[ir.Node]:
    """Every node the values need: their producers and, transitively, the producers of those
    nodes' inputs (graph inputs and initializers have none)."""
    seen: set[ir.Node] = set()
    stack = [v.producer() for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    return seen


@dataclass(frozen=True)
class GradientBlock:
    """A forward node's backward, as the values autodiff recorded for it: ``dys[i]`` is the
    gradient flowing into output ``i``, ``dxs[j]`` the node's contribution to input ``j``'s
    gradient (``None`` where there is none, or where a pass removed the value). A lowering
    rule that fuses the backward computes ``dxs`` from ``dys`` and the forward values, rewires
    the readers of each ``dxs[j]`` and leaves the nodes between to dead-code removal: it never
    needs to know which nodes the gradient rule emitted."""

    node: ir.Node
    dys: tuple[ir.Value | None, ...]
    dxs: tuple[ir.Value | None, ...]


def gradient_blocks(graph: ir.Graph) -> dict[ir.Node, GradientBlock]:
    """Each node of ``graph`` that records its backward (``NODE_GRAD_INPUTS``) -> its block.

    Example:
        >>> import onnx_ir as ir
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))
        >>> relu = ir.node("Relu", [x], metadata_props={
        ...     md.NODE_GRAD_INPUTS: '["dx"]', md.NODE_GRAD_OUTPUTS: '["dy"]'})
        >>> dy = ir.Value(name="dy")
        >>> back = ir.node("Mul", [dy, x])
        >>> back.outputs[0].name = "dx"
        >>> graph = ir.Graph([x, dy], [back.outputs[0]], nodes=[relu, back])
        >>> block = gradient_blocks(graph)[relu]
        >>> block.dys[0].name, block.dxs[0].producer() is back
        ('dy', True)
    """
    values: dict[str, ir.Value] = {}
    for value in graph.inputs:
        if value.name:
            values[value.name] = value
    for name, value in graph.initializers.items():
        values.setdefault(name, value)
    for node in graph:
        for value in node.outputs:
            if value.name:
                values[value.name] = value

    def resolve(names: str) -> tuple[ir.Value | None, ...]:
        return tuple(values.get(n) if n is not None else None for n in json.loads(names))

    blocks: dict[ir.Node, GradientBlock] = {}
    for node in graph:
        inputs = node.metadata_props.get(md.NODE_GRAD_INPUTS)
        if inputs is not None:
            outputs = node.metadata_props.get(md.NODE_GRAD_OUTPUTS, "[]")
            blocks[node] = GradientBlock(node, resolve(outputs), resolve(inputs))
    return blocks
