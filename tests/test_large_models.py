"""Models over protobuf's 2 GiB: what must work without serialising the whole model.

A float32 model of 540M parameters is 2.15 GB of weights; the ONNX checker serialises the model
before it checks it and protobuf refuses 2 GiB, so ``export_module`` failed on such a module
("Failed to serialize proto") until ``check_model_any_size`` checked it without its weights.
These tests force that path on small models (the threshold at 0 bytes).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import mpgraph.io as mio


def _matmul_model(x_type: int) -> ir.Model:
    w = nh.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "w")
    graph = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "g",
                         [h.make_tensor_value_info("x", x_type, [2, 64])],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w])
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10))


def test_a_model_checked_without_its_weights_still_fails_on_a_type_error():
    good, bad = _matmul_model(TensorProto.FLOAT), _matmul_model(TensorProto.INT64)
    before = good.graph.initializers["w"].const_value.numpy().copy()
    mio.check_model_any_size(good, large=0)
    with pytest.raises((onnx.checker.ValidationError, onnx.shape_inference.InferenceError), match="inconsistent type"):
        mio.check_model_any_size(bad, large=0)
    # the weights are back where they were, bytes and all
    np.testing.assert_array_equal(good.graph.initializers["w"].const_value.numpy(), before)


def test_export_checks_a_large_module_without_serialising_its_weights(monkeypatch):
    """``export_module`` over the threshold: the checker reads a file of the light copy (a path,
    not the proto), and the returned proto keeps every weight."""
    import torch

    from mpgraph.export import export_module

    checked: list[type] = []
    real = onnx.checker.check_model

    def spy(model, *args, **kwargs):
        checked.append(type(model))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(mio, "CHECK_WITHOUT_WEIGHTS_BYTES", 0)
    monkeypatch.setattr(onnx.checker, "check_model", spy)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    proto = export_module(module, torch.zeros((2, 16)), loss="cross_entropy")
    assert checked == [str]
    weights = {t.name: nh.to_array(t) for t in proto.graph.initializer}
    np.testing.assert_array_equal(weights["0.weight"], module[0].weight.detach().numpy())


def test_the_forward_is_shape_inferred_without_its_weights_when_large(monkeypatch):
    """``load_forward`` over the threshold infers shapes with the float weights' bytes out of the
    proto and back after: the same value types as the ordinary path, every weight intact."""
    import torch

    from mpgraph.export import export_module
    from mpgraph.training.normalize_forward import load_forward

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    proto = export_module(module, torch.zeros((2, 64)), loss="cross_entropy")
    seen: list[int] = []  # bytes of the weights inference was given
    real = onnx.shape_inference.infer_shapes

    def spy(model, *args, **kwargs):
        seen.append(sum(len(t.raw_data) for t in model.graph.initializer))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)

    def typed(forward) -> dict[str, str]:
        return {v.name: str(v.type) for node in forward.model.graph for v in node.outputs if v.type is not None}

    ordinary = load_forward(proto)
    monkeypatch.setattr(mio, "CHECK_WITHOUT_WEIGHTS_BYTES", 0)
    light = load_forward(proto)
    assert seen[0] > 64 * 128 * 4 > seen[-1]  # the ordinary path read the weights, the light one not
    assert typed(light) == typed(ordinary) and len(typed(light)) >= len(list(ordinary.model.graph))
    weight = light.model.graph.initializers["0.weight"].const_value.numpy()
    np.testing.assert_array_equal(weight, module[0].weight.detach().numpy())
