"""Deterministic, collision-free names for values and nodes a pass creates, and the Casts."""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir import meta as md

__all__ = ["NameScope", "make_cast"]


class NameScope:
    """Every value and node name of a model (subgraphs included), handing out fresh ones.

    ``fresh("cast/x_bf16")`` returns the name itself when unused, else ``cast/x_bf16_1``,
    ``cast/x_bf16_2``... so re-running a pass never collides with names it made before.
    """

    def __init__(self, model: ir.Model) -> None:
        self._used: set[str] = set()
        graph = model.graph
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
        name, i = base, 0
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        return name


def make_cast(name: str, value: ir.Value, to: ir.DataType, inserted: str, reason: str) -> ir.Node:
    """A ``Cast(value, to)`` node and output both named ``name``, marked as mpgraph's.

    Args:
        inserted: ``cast`` (policy boundary) or ``round`` (emulation rounding).
        reason: Shown by the audit.
    """
    return ir.Node(
        "",
        "Cast",
        [value],
        [ir.AttrInt64("to", to)],
        name=name,
        outputs=[ir.Value(name=name, type=ir.TensorType(to), shape=value.shape)],
        metadata_props={md.NODE_INSERTED: inserted, md.NODE_PRECISION: "none", md.NODE_REASON: reason},
    )
