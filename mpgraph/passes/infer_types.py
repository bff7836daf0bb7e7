"""InferTypesPass: give every value of the graph a dtype before precision is decided."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from mpgraph.optypes import node_typing

__all__ = ["InferTypesPass"]

logger = logging.getLogger(__name__)


class InferTypesPass(ir.passes.InPlacePass):
    """Runs ONNX shape inference and fills the dtypes it cannot.

    Rules:
        1. ONNX shape inference runs in strict mode; when it fails (custom ops, inconsistent
           value_info) it runs again in non-strict mode and the failure is logged.
        2. A node output still without a dtype takes the dtype its schema type variable is
           bound to by the node's inputs (``Add(float, float) -> float``).
        3. Values left without a dtype are never lowered and never cast.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = ShapeInferencePass(strict_mode=True)(model)
        if not result.modified and _missing_dtypes(model.graph):
            try:
                onnx.shape_inference.infer_shapes(ir.to_proto(model), strict_mode=True)
            except Exception as e:  # noqa: BLE001 - onnx raises several unrelated types
                logger.info("strict shape inference failed (%s); retrying non-strict", str(e).splitlines()[0])
                result = ShapeInferencePass(strict_mode=False)(model)
        modified = result.modified
        opsets = dict(model.opset_imports)
        for node in model.graph:
            if all(out.dtype is not None for out in node.outputs):
                continue
            typing = node_typing(node, opsets)
            for var, out in zip(typing.output_vars, node.outputs):
                if out.dtype is None and var is not None and var in typing.bound:
                    out.dtype = typing.bound[var]
                    modified = True
        return ir.passes.PassResult(model, modified)


def _missing_dtypes(graph: ir.Graph) -> bool:
    return any(out.dtype is None for node in graph for out in node.outputs if out.name)
