"""Probing: the ONNX Runtime (CPU) runs the compiler and the audit make to look at numbers.

The compiler folds constants and measures activation ranges, and the audit compares outputs;
each runs ORT once on CPU, unoptimized, and reads arrays back. Every such run goes through
this module, so nothing outside ``mpgraph/runtime/`` imports onnxruntime.

Example:
    >>> import numpy as np
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    >>> node = ir.Node("", "Neg", [x], name="neg")
    >>> node.outputs[0].name = "y"
    >>> model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}), ir_version=8)
    >>> session = cpu_session(model)
    >>> session.run(None, {"x": np.array([1.0, -2.0], np.float32)})[0].tolist()
    [-1.0, 2.0]
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mpgraph.errors import MpgraphError

__all__ = ["cpu_session", "evaluate_nodes"]

logger = logging.getLogger(__name__)


def cpu_session(
    model: ir.Model | onnx.ModelProto | bytes, *, log_severity: int = 4, threads: int | None = None
) -> ort.InferenceSession:
    """An unoptimized ORT CPU session, as every probe runs.

    No graph optimization, so no fusion skips an emulation rounding, and a 10k-node graph's
    session is made in a third of the time.

    Args:
        model: The model, as onnx-ir, protobuf or serialized bytes.
        log_severity: ORT's ``log_severity_level``; 4 (fatal only) because failures come
            back as one-line ``MpgraphError`` s.
        threads: ``intra_op_num_threads``; ORT's default (all cores) when None.

    Raises:
        MpgraphError: ORT cannot load the model (the first line of its message).
    """
    if isinstance(model, ir.Model):
        model = ir.to_proto(model)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = log_severity
    if threads is not None:
        options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise MpgraphError(f"ONNX Runtime (CPU) cannot load the model: {first_line(e)}") from None


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none.

    Example:
        >>> first_line(ValueError("bad shape\\nat node 3"))
        'bad shape'
        >>> first_line(KeyError())
        'KeyError'
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def evaluate_nodes(graph: ir.Graph, nodes: list[ir.Node], values: list[ir.Value]) -> list[np.ndarray] | None:
    """Run ``nodes`` (constant inputs only) of ``graph`` on ORT CPU and return ``values``.

    Used to fold constant subgraphs; None (with a warning) when ORT cannot evaluate them,
    since folding is an optimization.
    """
    inits = {v.name for n in nodes for v in n.inputs if v is not None and v.is_initializer()}
    names = [v.name or "" for v in values]
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(
            [ir.serde.serialize_node(n) for n in nodes], "fold", [],
            [onnx.helper.make_tensor_value_info(v.name, int(v.dtype), None) for v in values if v.dtype is not None],
            [ir.serde.serialize_tensor(graph.initializers[name].const_value) for name in sorted(n for n in inits if n)],
        ),
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in graph.opset_imports.items()],
    )
    proto.ir_version = max(8, onnx.helper.find_min_ir_version_for(list(proto.opset_import), True))
    try:
        session = cpu_session(proto, log_severity=3)
        return [np.asarray(a) for a in session.run(names, {})]
    except Exception as e:  # noqa: BLE001 - ORT raises many types; folding is an optimization
        logger.warning("constant folding skipped: ONNX Runtime cannot evaluate the constant subgraphs (%s)", first_line(e))
        return None
