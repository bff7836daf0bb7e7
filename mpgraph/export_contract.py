"""The contract an exported model follows (listed in ``mpgraph.export``'s docstring): its fixed
names and IR version, ``finish_export`` that makes torch's graph hold it (parameter
initializers, buffers as constants, the batch dimension named ``batch``, no source metadata,
so the same module gives the same bytes) and ``validate_export`` that checks it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph.errors import ExportError, first_line
from mpgraph.io import check_model_any_size

__all__ = ["BATCH_DIM", "IR_VERSION", "LABEL_NAME", "LOGITS_NAME", "LOSS_NAME", "finish_export", "validate_export"]

BATCH_DIM = "batch"
LABEL_NAME = "label"
LOGITS_NAME = "logits"
LOSS_NAME = "loss"
#: The IR version of every exported model (opset 23 would need 11).
IR_VERSION = 10


def finish_export(
    model: ir.Model, params: dict[str, Any], buffers: dict[str, Any], dynamic_batch: bool
) -> None:
    """Attaches parameter initializers, turns buffers into constants, names the batch dim."""
    graph = model.graph
    batch_symbol = None
    if dynamic_batch and graph.inputs and graph.inputs[0].shape:
        first = graph.inputs[0].shape[0]
        if isinstance(first, ir.SymbolicDim) and first.value:
            batch_symbol = first.value
    inputs = {value.name: value for value in graph.inputs}
    for name, param in params.items():
        value = inputs.get(name)
        if value is None:
            raise ExportError(f"parameter {name!r} is missing from the exported graph inputs")
        array = param.detach().float().cpu().numpy()
        value.const_value = ir.tensor(np.ascontiguousarray(array), name=name)
        graph.register_initializer(value)
    for name, buffer in buffers.items():
        value = inputs.get(name)
        if value is None:
            raise ExportError(f"buffer {name!r} is missing from the exported graph inputs")
        graph.inputs.remove(value)
        if not value.uses():
            continue
        array = buffer.detach().to("cpu").numpy()
        value.const_value = ir.tensor(np.ascontiguousarray(array), name=name)
        graph.register_initializer(value)

    if batch_symbol is not None:
        _rename_symbol(graph, batch_symbol, BATCH_DIM)

    model.ir_version = IR_VERSION
    model.doc_string = None
    model.metadata_props.clear()
    graph.metadata_props.clear()
    graph.doc_string = None
    for node in ir.traversal.RecursiveGraphIterator(graph):
        node.metadata_props.clear()
        node.doc_string = None
        for output in node.outputs:
            output.metadata_props.clear()
            output.doc_string = None
    for value in [*graph.inputs, *graph.outputs, *graph.initializers.values()]:
        value.metadata_props.clear()
        value.doc_string = None


def _rename_symbol(graph: ir.Graph, old: str, new: str) -> None:
    """Renames a symbolic dimension everywhere, also inside expressions such as ``16*s0``."""
    pattern = re.compile(rf"\b{re.escape(old)}\b")
    values = [*graph.inputs, *graph.initializers.values()]
    values += [out for node in graph for out in node.outputs]
    for value in values:
        shape = value.shape
        if shape is None:
            continue
        dims = [
            ir.SymbolicDim(pattern.sub(new, dim.value))
            if isinstance(dim, ir.SymbolicDim) and dim.value
            else dim
            for dim in shape
        ]
        if dims != list(shape):
            value.shape = ir.Shape(dims)


def validate_export(
    proto: onnx.ModelProto,
    arg_names: list[str],
    output_names: list[str],
    dynamic_batch: bool,
    num_batched_inputs: int,
    model: ir.Model | None = None,
) -> None:
    """The exported proto has the expected inputs and outputs, only the default domain, the
    batch dimension where it belongs, and passes the ONNX checker (full check). With ``model``
    (what ``proto`` serialises) a model over 2 GiB is checked too, without its weights
    (``mpgraph.io.check_model_any_size``)."""
    graph = proto.graph
    actual_inputs = [value.name for value in graph.input]
    if actual_inputs != arg_names:
        raise ExportError(f"exported inputs {actual_inputs} differ from expected {arg_names}")
    actual_outputs = [value.name for value in graph.output]
    if actual_outputs != output_names:
        raise ExportError(f"exported outputs {actual_outputs} differ from expected {output_names}")
    domains = {opset.domain for opset in proto.opset_import} - {"", "ai.onnx"}
    if domains or proto.functions:
        raise ExportError(f"export used non-standard domains or functions: {sorted(domains)}")
    if dynamic_batch:
        batched = [*graph.input[:num_batched_inputs], *graph.output[-1:]]
        for value in batched:
            dims = value.type.tensor_type.shape.dim
            if not dims or dims[0].dim_param != BATCH_DIM:
                raise ExportError(
                    f"torch specialised the batch dimension of {value.name!r};"
                    " the module's forward depends on the batch size"
                )
    try:
        if model is not None:
            check_model_any_size(model, proto)
        else:
            onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ExportError(f"exported model fails the ONNX checker: {first_line(e)}") from e
