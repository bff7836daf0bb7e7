"""ValidateModelPass: the rewritten model is valid ONNX and honours the policy."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from mpgraph import metadata as md
from mpgraph.dtypes import is_float
from mpgraph.errors import ValidationError
from mpgraph.optypes import node_typing

__all__ = ["ValidateModelPass", "check_onnx", "check_precision_invariants"]

#: Above this many bytes a model proto cannot be serialised in one piece; validate the saved file.
PROTO_LIMIT = 2_000_000_000


def check_onnx(proto_or_path: onnx.ModelProto | str) -> None:
    """``onnx.checker`` (full) and strict shape inference; raises ``ValidationError``."""
    try:
        onnx.checker.check_model(proto_or_path, full_check=True)
        if isinstance(proto_or_path, str):
            onnx.shape_inference.infer_shapes_path(proto_or_path, proto_or_path + ".inferred", strict_mode=True, check_type=True)
        else:
            onnx.shape_inference.infer_shapes(proto_or_path, strict_mode=True, check_type=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValidationError(f"rewritten model is invalid ONNX: {first}") from None


def check_precision_invariants(model: ir.Model) -> None:
    """No low-precision value reaches a compute slot of a node decided float32."""
    opsets = dict(model.opset_imports)
    for node in model.graph:
        if node.metadata_props.get(md.NODE_PRECISION) != "float32":
            continue
        if node.metadata_props.get(md.NODE_REASON, "").startswith("computes in"):
            continue  # the input model already ran this node in another float type
        typing = node_typing(node, opsets)
        for i in typing.compute_inputs():
            value = node.inputs[i]
            if value is not None and value.dtype is not None and is_float(value.dtype) and value.dtype != ir.DataType.FLOAT:
                raise ValidationError(
                    f"{node.op_type} '{node.name}' is decided float32 but input {i} "
                    f"'{value.name}' is {value.dtype.name.lower()}"
                )


class ValidateModelPass(ir.passes.InPlacePass):
    """Checks, changes nothing.

    Rules:
        1. ``onnx.checker.check_model(full_check=True)`` passes.
        2. Strict shape inference with type checking passes.
        3. No low-precision value reaches a compute input of a float32 node (deny ops included).
    Models too large for one protobuf are checked after saving, from the file.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        check_precision_invariants(model)
        proto = ir.to_proto(model)
        if proto.ByteSize() < PROTO_LIMIT:
            check_onnx(proto)
        return ir.passes.PassResult(model, False)
