"""The graphs a check runs: the user's model with Dropout in inference mode, and the forward
part of the gradient graph cut down to the values a check reads."""

from __future__ import annotations

import os
from collections.abc import Sequence

import onnx
import onnx_ir as ir

__all__ = ["forward_model", "identity", "inference_dropout", "load"]


def load(model: ir.Model | onnx.ModelProto | str | os.PathLike[str]) -> ir.Model:
    """A model the check may edit: a copy of an ``ir.Model``, or one loaded from protobuf or a path."""
    if isinstance(model, ir.Model):
        return ir.from_proto(ir.to_proto(model))  # a copy: Dropout is edited
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model)
    from mpgraph.io import load_model

    return load_model(model)


def inference_dropout(graph: ir.Graph) -> int:
    """Drop Dropout's ``training_mode`` input (inference: identity). Returns how many changed."""
    changed = 0
    for node in graph:
        if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
            tensor = ir.convenience.get_const_tensor(node.inputs[2])
            if tensor is None or bool(tensor.numpy().reshape(-1)[0]):
                changed += 1
            node.resize_inputs(2)
    return changed


def forward_model(step: ir.Model, outputs: Sequence[str]) -> ir.Model:
    """A copy of the forward part of the gradient graph computing ``outputs`` (backward pruned)."""
    copy = ir.from_proto(ir.to_proto(step))
    values = {v.name: v for node in copy.graph for v in node.outputs}
    values.update({v.name: v for v in copy.graph.inputs})
    copy.graph.outputs.clear()
    for name in outputs:
        value = values[name]
        if value.is_graph_input():
            value = identity(copy.graph, value, f"check/{name}")
        copy.graph.outputs.append(value)
    live: set[ir.Value] = set(copy.graph.outputs)
    for node in reversed(list(copy.graph)):
        if any(o in live for o in node.outputs):
            live.update(v for v in node.inputs if v is not None)
        else:
            copy.graph.remove(node, safe=False)
    for name, value in list(copy.graph.initializers.items()):
        if value not in live and not value.is_graph_input():
            del copy.graph.initializers[name]
    return copy


def identity(graph: ir.Graph, value: ir.Value, name: str) -> ir.Value:
    """Append ``Identity(value)``, node and output named ``name``."""
    node = ir.Node("", "Identity", [value], name=name)
    node.outputs[0].name = name
    node.outputs[0].dtype = value.dtype
    node.outputs[0].shape = value.shape
    graph.append(node)
    return node.outputs[0]
