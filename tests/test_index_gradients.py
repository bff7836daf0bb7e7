"""Gradients of index-taking ops in whole step graphs, run in ORT CPU against torch.autograd.

The one-op cases are in ``test_gradients.py``; these cover what a one-op table cannot:
the BERT/ViT pooler ``hidden[:, 0]`` as the exporters write it (a ``Gather`` on axis 1 with a
rank-0 index, after an embedding ``Gather``), and index inputs that are only known at run time
(Slice starts, Pad pads, Gather indices fed as graph inputs).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mpgraph.training import build_training_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional


class Pooler(torch.nn.Module):
    """Embedding -> hidden[:, 0] (the CLS token) -> Linear -> tanh -> Linear -> cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 8)
        self.pool = torch.nn.Linear(8, 8)
        self.cls = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(ids)
        return F.cross_entropy(self.cls(torch.tanh(self.pool(hidden[:, 0]))), labels)


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _export(module: torch.nn.Module, args: tuple, dynamo: bool) -> onnx.ModelProto:
    names = {"input_names": ["ids", "labels"], "output_names": ["loss"], "opset_version": 18}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation, training-mode export
        if dynamo:
            return torch.onnx.export(module, args, dynamo=True, verbose=False, **names).model_proto
        f = io.BytesIO()
        torch.onnx.export(module, args, f, dynamo=False, do_constant_folding=False, **names)
        return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_pooler_first_token_step_graph_matches_torch(dynamo: bool) -> None:
    module = Pooler()
    # Token ids repeat within and across rows, and the CLS position's ids repeat across the
    # batch: the embedding gradient must accumulate on both Gathers.
    ids = torch.tensor([[3, 5, 3, 0, 10], [3, 1, 1, 2, 9], [7, 7, 7, 7, 7], [0, 3, 4, 5, 6]])
    labels = torch.tensor([0, 2, 1, 2])
    proto = _export(module, (ids, labels), dynamo)
    gathers = [n for n in proto.graph.node if n.op_type == "Gather"]
    assert any(a.name == "axis" and a.i == 1 for n in gathers for a in n.attribute), "export has no axis-1 Gather"

    step = build_training_graph(proto, optimizer=None, loss="loss")
    session = _session(step)
    names = [o.name for o in session.get_outputs()]
    result = dict(zip(names, session.run(None, {"ids": ids.numpy(), "labels": labels.numpy()}), strict=True))

    module.zero_grad()
    loss = module(ids, labels)
    loss.backward()
    assert abs(float(result["loss"]) - loss.item()) <= 1e-6
    params = dict(module.named_parameters())
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    checked = 0
    for name, param in params.items():
        # An export names its initializers after the parameters (torchscript may transpose a
        # Linear weight into an anonymous initializer: match those by value).
        value = param.detach().numpy()
        match = name if name in inits else next(
            (k for k, v in inits.items() if v.shape == value.T.shape and np.array_equal(v, value.T)), None)
        assert match is not None, f"parameter {name} not found in the export"
        grad = result[f"grad/{match}"]
        expected = param.grad.numpy() if inits[match].shape == param.shape else param.grad.numpy().T
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6, err_msg=name)
        checked += 1
    assert checked == 5


def _run_step(nodes: list, inputs: list, feeds: dict[str, np.ndarray], wrt: list[str]) -> dict[str, np.ndarray]:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=wrt)
    session = _session(step)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def _weighted_sum(y: str, c: np.ndarray) -> list:
    return [helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(c)),
            helper.make_node("Mul", [y, "c"], ["p"]), helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]


def _torch_grad(x: np.ndarray, fn, c: np.ndarray) -> np.ndarray:
    t = torch.tensor(x, requires_grad=True)
    (fn(t) * torch.tensor(c)).sum().backward()
    return t.grad.numpy()


@pytest.mark.parametrize(("starts", "ends", "expected"), [
    ([1, -3], [3, 100], np.s_[1:3, -3:]),
    ([-100, 9], [-1, 12], np.s_[:-1, 9:12]),
    ([-2, 0], [2**62, 2], np.s_[-2:, 0:2]),
])
def test_slice_runtime_starts(starts: list[int], ends: list[int], expected: tuple) -> None:
    """Unit-step Slice whose starts are a graph input: wrapped and clamped at run time."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6))
    c = rng.standard_normal(x[expected].shape)
    nodes = [helper.make_node("Slice", ["x", "starts", "ends"], ["y"])] + _weighted_sum("y", c)
    inputs = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 6]),
              helper.make_tensor_value_info("starts", TensorProto.INT64, [2]),
              helper.make_tensor_value_info("ends", TensorProto.INT64, [2])]
    feeds = {"x": x, "starts": np.asarray(starts, np.int64), "ends": np.asarray(ends, np.int64)}
    grad = _run_step(nodes, inputs, feeds, ["x"])["grad/x"]
    np.testing.assert_allclose(grad, _torch_grad(x, lambda t: t[expected], c), rtol=1e-12)


def test_pad_runtime_pads() -> None:
    """Constant Pad whose pads are computed at run time (Swin's TorchScript export), cropping too."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5))
    pads = np.asarray([0, 2, -1, 0, 1, 3], np.int64)  # axis1: +2/+1, axis2: -1/+3
    c = rng.standard_normal((2, 6, 7))
    nodes = [helper.make_node("Identity", ["pads_in"], ["pads"]), helper.make_node("Pad", ["x", "pads"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 5]),
              helper.make_tensor_value_info("pads_in", TensorProto.INT64, [6])]
    grad = _run_step(nodes + _weighted_sum("y", c), inputs, {"x": x, "pads_in": pads}, ["x"])["grad/x"]
    np.testing.assert_allclose(grad, _torch_grad(x, lambda t: F.pad(t, (-1, 3, 2, 1)), c), rtol=1e-12)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_runtime_indices(axis: int) -> None:
    """Gather with a rank-0 index fed at run time (negative, and past the middle), every axis."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 5))
    for index in (-1, 2):
        y = np.take(x, index, axis=axis)
        c = rng.standard_normal(y.shape)
        nodes = [helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)] + _weighted_sum("y", c)
        inputs = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 4, 5]),
                  helper.make_tensor_value_info("i", TensorProto.INT64, [])]
        grad = _run_step(nodes, inputs, {"x": x, "i": np.asarray(index, np.int64)}, ["x"])["grad/x"]
        expected = _torch_grad(x, lambda t: torch.select(t, axis, index), c)  # noqa: B023
        np.testing.assert_allclose(grad, expected, rtol=1e-12)
