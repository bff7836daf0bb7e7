"""The forward part of a step graph, for an evaluation session (``PlanOptions.forward_of``).

Example:
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd")
    >>> forward = forward_part(step, "logits")
    >>> [v.name for v in forward.graph.outputs], len(forward.graph) < len(step.graph)
    (['logits'], True)
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir.links import ancestors
from mpgraph.errors import MpgraphError
from mpgraph.io import ModelLike, as_model

__all__ = ["forward_part"]


def forward_part(step: ModelLike, target: str) -> ir.Model:
    """The forward part of a step graph: its inputs -> ``target`` as float32.

    A new model: the nodes ``target`` depends on, the graph inputs and initializers they
    read, and a Cast to float32 when ``target`` is in low precision (numpy has no bfloat16).

    Args:
        step: The step graph (serialized, it is never changed; for a trainer, its state
            inputs without initializers, so they are bound at run time).
        target: The value to compute (the contract's logits).
    """
    model = as_model(step, copy=True)
    graph = model.graph
    value = next((v for n in graph for v in n.outputs if v.name == target), None)
    if value is None:
        raise MpgraphError(f"cannot evaluate: the step graph has no value '{target}'")
    needed = ancestors([value])
    output = value
    if value.dtype != ir.DataType.FLOAT:
        output = ir.Value(name=f"{target}/float32", type=ir.TensorType(ir.DataType.FLOAT), shape=value.shape)
        graph.append(ir.node("Cast", [value], {"to": ir.DataType.FLOAT}, name=output.name, outputs=[output]))
    graph.outputs.clear()
    graph.outputs.append(output)
    graph.remove([n for n in graph if n not in needed and n is not output.producer()], safe=True)
    for node in graph:
        for v in node.outputs:
            if v is not output:
                # No value_info: ORT then optimizes the forward graph as it always has (with
                # them it fuses differently, and the zoo GPT's logits move by 6e-7).
                v.type, v.shape = None, None
    for v in [v for v in graph.inputs if not v.uses()]:
        graph.inputs.remove(v)
    for name in [name for name, v in graph.initializers.items() if not v.uses()]:
        graph.initializers.pop(name)
    model.metadata_props.clear()
    return model
