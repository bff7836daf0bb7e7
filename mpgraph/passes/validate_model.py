"""ValidateModelPass: the rewritten model is valid ONNX and honours the policy."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import google.protobuf.message
import onnx
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.meta import Phase, Precision
from mpgraph.dtypes import float_weight_bytes, is_float
from mpgraph.errors import ValidationError
from mpgraph.io import tensor_bytes
from mpgraph.optypes import node_typing
from mpgraph.passes.infer_types import INPUT_INVALID_META

__all__ = ["ValidateModelPass", "check_onnx", "check_precision_invariants", "check_saved"]

logger = logging.getLogger(__name__)

#: Above this many bytes a model proto cannot be serialised in one piece; validate the saved file.
PROTO_LIMIT = 2_000_000_000
#: Above this many bytes of initializers, validate a saved copy (external data) to save memory.
FILE_CHECK_BYTES = 256 * 2**20


def check_onnx(proto_or_path: onnx.ModelProto | str, input_problem: str | None = None) -> None:
    """``onnx.checker`` with ``full_check`` (which runs strict, type-checked shape inference).

    Raises:
        ValidationError: Naming the first problem, and the input's own strict-inference
            failure when there was one (the rewrite did not cause it).
    """
    try:
        onnx.checker.check_model(proto_or_path, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if input_problem is not None:
            raise ValidationError(
                f"rewritten model is invalid ONNX: {first} (the input model already fails strict "
                f"shape inference: {input_problem})"
            ) from e
        raise ValidationError(f"rewritten model is invalid ONNX: {first}") from e


def check_precision_invariants(model: ir.Model) -> None:
    """No low-precision value reaches a compute slot of a node decided float32."""
    opsets = dict(model.opset_imports)
    for node in model.graph:
        if node.metadata_props.get(md.NODE_PRECISION) != Precision.FLOAT32:
            continue
        if node.metadata_props.get(md.NODE_PHASE) == Phase.INPUT_DTYPE:
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
    Models too large for one protobuf (2 GB) are never serialised here: protobuf cannot
    even measure them (``ByteSize`` raises ``EncodeError``), and a copy would double the
    memory. Their float weights alone over ``PROTO_LIMIT``: ``convert_file`` checks the saved
    file (external data). Models whose tensors exceed ``FILE_CHECK_BYTES`` are written to a
    temporary folder with external data and the file is checked: an in-memory check would
    hold three more copies of the weights (the proto, its serialisation, the checker's parse).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        check_precision_invariants(model)
        if float_weight_bytes(model) >= PROTO_LIMIT:
            logger.info("model too large for one protobuf: checked from the saved file")
            return ir.passes.PassResult(model, False)
        problem = model.meta.get(INPUT_INVALID_META)
        if tensor_bytes(model) > FILE_CHECK_BYTES:
            check_saved(model, problem)
            return ir.passes.PassResult(model, False)
        proto = ir.to_proto(model)
        try:
            size = proto.ByteSize()
        except (google.protobuf.message.EncodeError, ValueError, OverflowError):
            size = None
        if size is not None and size < PROTO_LIMIT:
            check_onnx(proto, problem)
        else:
            del proto
            check_saved(model, problem)
        return ir.passes.PassResult(model, False)


def check_saved(model: ir.Model, input_problem: str | None = None) -> None:
    """``check_onnx`` on a temporary copy of ``model`` saved with external data (any size)."""
    with tempfile.TemporaryDirectory(prefix="mpgraph-validate-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        check_onnx(str(path), input_problem)
