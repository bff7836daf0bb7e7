"""The ONNX Runtime sessions ``mpgraph.check_grad`` runs its float64 and float32 graphs in.

Unlike ``probe.cpu_session`` (unoptimized, for emulation-exact probes), these keep ORT's
default graph optimizations: the check measures the gradients a user's step graph computes,
and ORT optimizes that graph when it trains. Errors come back as one-line ``MpgraphError`` s
whose text keeps ORT's own wording (``Could not find an implementation for Erf(13)``), which
``check_grad`` reads to find the op types that have no float64 kernel.

Example:
    >>> import numpy as np
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.DOUBLE), shape=ir.Shape([2]))
    >>> node = ir.Node("", "Neg", [x], name="neg")
    >>> node.outputs[0].name = "y"
    >>> model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}), ir_version=8)
    >>> CheckSession(model).run(["y"], {"x": np.array([1.0, -2.0]), "unused": np.zeros(1)})[0].tolist()
    [-1.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mpgraph.errors import MpgraphError
from mpgraph.runtime.probe import first_line

__all__ = ["CheckSession", "ort_message"]


def ort_message(error: BaseException) -> str:
    """The first line of an ORT error without ORT's ``[ONNXRuntimeError] :`` prefix.

    Example:
        >>> ort_message(RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : no kernel\\nmore"))
        '9 : NOT_IMPLEMENTED : no kernel'
    """
    return first_line(error).replace("[ONNXRuntimeError] : ", "")


class CheckSession:
    """An ORT CPU session with ORT's default optimizations.

    Args:
        model: The model, as onnx-ir or protobuf.

    Raises:
        MpgraphError: ORT cannot load the model (``ort_message`` of its error).
    """

    def __init__(self, model: ir.Model | onnx.ModelProto) -> None:
        proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
        options = ort.SessionOptions()
        # ORT warns once per initializer that is also a graph input (every parameter here).
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - ORT raises its own Fail/NotImplemented types
            raise MpgraphError(ort_message(e)) from None
        # Parameters are initializers that are also graph inputs: ORT lists them apart.
        overridable = self._session.get_overridable_initializers()
        self._inputs = {i.name for i in [*self._session.get_inputs(), *overridable]}

    def run(self, outputs: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run the session on the ``feeds`` it takes (others are ignored).

        Raises:
            MpgraphError: ORT fails at run time.
        """
        try:
            return list(self._session.run(list(outputs), {k: v for k, v in feeds.items() if k in self._inputs}))
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise MpgraphError(f"onnxruntime failed to run the gradient check: {ort_message(e)}") from None
