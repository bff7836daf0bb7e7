"""The underflow case from the mixed-precision literature, as an ONNX forward model.

``y = x @ W``, ``loss = 1e-8 * mean((y - t)^2)``: dloss/dy is about 1e-8, below float16's
smallest subnormal (6e-8), so an fp16 backward MatMul without loss scaling loses it. ``W``
starts at zero, so one SGD step with lr=1 leaves exactly ``-grad`` in ``W``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

__all__ = ["underflow_model"]


def underflow_model(d_in: int, d_out: int, tiny: float = 1e-8) -> onnx.ModelProto:
    """The model with ``x: [N, d_in]``, ``t: [N, d_out]`` and the parameter ``W: [d_in, d_out]``;
    ``tiny`` is the constant factor that scales the loss (and every gradient) down."""
    nodes = [
        h.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
        h.make_node("Sub", ["y", "t"], ["d"], name="sub"),
        h.make_node("Mul", ["d", "d"], ["sq"], name="square"),
        h.make_node("ReduceMean", ["sq"], ["mean"], name="mean", keepdims=0),
        h.make_node("Mul", ["mean", "tiny"], ["loss"], name="scale_down"),
    ]
    graph = h.make_graph(
        nodes,
        "underflow",
        [h.make_tensor_value_info("x", T.FLOAT, ["N", d_in]), h.make_tensor_value_info("t", T.FLOAT, ["N", d_out]),
         h.make_tensor_value_info("W", T.FLOAT, [d_in, d_out])],
        [h.make_tensor_value_info("loss", T.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.zeros((d_in, d_out), np.float32), "W"),
                     numpy_helper.from_array(np.array(tiny, np.float32), "tiny")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 9
    return model
