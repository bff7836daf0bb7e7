"""InferTypesPass: give every value of the graph a type before precision is decided."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
from onnx_ir import serde

from mpgraph.optypes import node_typing

__all__ = ["InferTypesPass", "INPUT_INVALID_META"]

logger = logging.getLogger(__name__)

_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
_KEEP_BYTES = 4096

#: ``model.meta`` key (in memory only): why the *input* model fails strict shape inference,
#: so a later validation failure can say the problem predates the rewrite.
INPUT_INVALID_META = "mpgraph.input_strict_inference_error"


class InferTypesPass(ir.passes.InPlacePass):
    """Runs ONNX shape inference once and fills the types it finds.

    Rules:
        1. ONNX shape inference runs in strict mode; when it fails (custom ops, inconsistent
           value_info) the failure is remembered in ``model.meta`` and it runs non-strict.
        2. Every main-graph value without a type or shape takes the inferred one (tensor,
           sequence or optional types alike); types and shapes already present are kept.
        3. A node output still without a dtype takes the dtype its schema type variable is
           bound to by the node's inputs (``Add(float, float) -> float``).
        4. Values left without a dtype are never lowered and never cast.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        untyped = {
            v.name: v for node in graph for v in node.outputs if v.name and (v.type is None or v.shape is None)
        }
        modified = False
        if untyped:
            from mpgraph.io import shape_only_initializers

            with shape_only_initializers(model, _KEEP_BYTES):  # no copy of the weights (2.5 GB models)
                proto = ir.to_proto(model)
            # Large float weights carry no shape information (shape arithmetic reads integer
            # tensors and small constants); dropping their bytes makes inference ~5x faster.
            for tensor in proto.graph.initializer:
                if tensor.data_type in _FLOAT_TYPES and len(tensor.raw_data) > _KEEP_BYTES:
                    tensor.ClearField("raw_data")
            try:
                inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
            except (onnx.shape_inference.InferenceError, RuntimeError, ValueError) as e:
                message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                model.meta[INPUT_INVALID_META] = message
                logger.info("strict shape inference failed on the input (%s); retrying non-strict", message)
                try:
                    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
                except Exception:  # noqa: BLE001 - best effort: rule 3 still applies
                    inferred = proto
            for info in (*inferred.graph.value_info, *inferred.graph.output):
                value = untyped.get(info.name)
                if value is None or not info.type.WhichOneof("value"):
                    continue
                if value.type is None:
                    value.type = serde.deserialize_type_proto_for_type(info.type)
                    modified = True
                shape = serde.deserialize_type_proto_for_shape(info.type)
                if value.shape is None and shape is not None:
                    value.shape = shape
                    modified = True
        opsets = dict(model.opset_imports)
        for node in graph:
            if all(out.dtype is not None for out in node.outputs):
                continue
            typing = node_typing(node, opsets)
            for var, out in zip(typing.output_vars, node.outputs):
                if out.dtype is None and var is not None and var in typing.bound:
                    out.dtype = typing.bound[var]
                    modified = True
        return ir.passes.PassResult(model, modified)
