"""RNN, GRU and LSTM in training graphs (``mpgraph/autodiff/lower_recurrent.py``).

1. The unrolled form computes what ONNX Runtime's kernels compute, option by option
   (directions, states, biases, ``sequence_lens``, ``clip``, peepholes, ``input_forget``,
   activations with alpha/beta, ``layout``).
2. Models exported from ``torch.nn.LSTM``/``GRU``/``RNN`` by the TorchScript exporter train: every
   parameter gradient of the step graph matches ``torch.autograd`` (relative L2 <= 1e-4), both
   with the recurrent nodes kept (gradient rule) and lowered before differentiation.
3. A sequence length that is not static is refused with a message naming the node and the fix.

The per-op gradient checks (finite differences and torch) are in ``test_gradients.py``.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpgraph.autodiff import differentiate
from mpgraph.autodiff.lower_recurrent import lower_recurrent
from mpgraph.errors import GradientError
from mpgraph.training import build_training_graph

torch = pytest.importorskip("torch")

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _states(a: np.ndarray, layout: int) -> np.ndarray:
    """[dirs, B, H] in the node's layout."""
    return a.transpose(1, 0, 2).copy() if layout else a


def _model(op: str, *, steps: int = 4, batch: int = 3, inputs: int = 5, hidden: int = 2, direction: str = "forward",
           layout: int = 0, lens: list[int] | None = None, h0: bool = True, c0: bool = True, peepholes: bool = False,
           bias: bool = True, attrs: dict[str, Any] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-node model whose weights, biases and states are initializers, and its X feed."""
    dirs, gates = (2 if direction == "bidirectional" else 1), _GATES[op]
    rng = np.random.default_rng(0)

    def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x = rand(steps, batch, inputs)
    x = x.transpose(1, 0, 2).copy() if layout else x
    inits = {"W": rand(dirs, gates * hidden, inputs, scale=0.5), "R": rand(dirs, gates * hidden, hidden, scale=0.5)}
    names = ["X", "W", "R", "B" if bias else "", "L" if lens is not None else "", "H0" if h0 else ""]
    if bias:
        inits["B"] = rand(dirs, 2 * gates * hidden, scale=0.3)
    if lens is not None:
        inits["L"] = np.asarray(lens, np.int32)
    if h0:
        inits["H0"] = _states(rand(dirs, batch, hidden), layout)
    if op == "LSTM":
        names += ["C0" if c0 else "", "P" if peepholes else ""]
        if c0:
            inits["C0"] = _states(rand(dirs, batch, hidden), layout)
        if peepholes:
            inits["P"] = rand(dirs, 3 * hidden, scale=0.5)
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][: 3 if op == "LSTM" else 2]
    node = helper.make_node(op, names, outs, name="rec", hidden_size=hidden, direction=direction, layout=layout, **(attrs or {}))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model), {"X": x}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _lowered(model: onnx.ModelProto) -> onnx.ModelProto:
    m = ir.from_proto(model)
    assert lower_recurrent(m.graph) == sum(n.op_type in _GATES for n in model.graph.node)
    assert not any(n.op_type in _GATES for n in m.graph)
    proto = ir.to_proto(m)
    onnx.checker.check_model(proto, full_check=True)
    return proto


FORWARD_CASES = [
    *[(op, {"direction": d}) for op in _GATES for d in ("forward", "reverse", "bidirectional")],
    *[(op, {"direction": "bidirectional", "lens": [4, 2, 1]}) for op in _GATES],
    *[(op, {"h0": False, "c0": False, "bias": False}) for op in _GATES],
    *[(op, {"direction": "bidirectional", "attrs": {"clip": 0.4}}) for op in _GATES],
    ("GRU", {"direction": "bidirectional", "attrs": {"linear_before_reset": 1}}),
    ("GRU", {"direction": "reverse", "lens": [3, 4, 2], "attrs": {"linear_before_reset": 1}}),
    ("LSTM", {"direction": "bidirectional", "peepholes": True, "attrs": {"clip": 2.0}}),
    ("LSTM", {"peepholes": True}),
    ("LSTM", {"peepholes": True, "attrs": {"input_forget": 1}}),
    ("LSTM", {"steps": 1, "direction": "bidirectional"}),
    ("RNN", {"attrs": {"activations": ["Relu"]}}),
    ("GRU", {"direction": "bidirectional", "attrs": {"activations": ["HardSigmoid", "Softsign", "LeakyRelu", "Tanh"],
                                                     "activation_alpha": [0.3, 0.2], "activation_beta": [0.4]}}),
    ("LSTM", {"attrs": {"activations": ["HardSigmoid", "Elu", "ScaledTanh"], "activation_alpha": [0.3, 0.9, 1.5],
                        "activation_beta": [0.4, 0.7]}}),
]


@pytest.mark.parametrize(("op", "kw"), FORWARD_CASES, ids=[f"{op}-{kw}" for op, kw in FORWARD_CASES])
def test_unrolled_forward_matches_onnxruntime(op: str, kw: dict[str, Any]) -> None:
    model, feeds = _model(op, **kw)
    expected, got = _run(model, feeds), _run(_lowered(model), feeds)
    for k, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert e.shape == g.shape, k
        # float32 kernels in a different order: a few ulps of the largest value
        assert np.abs(e - g).max() <= 2e-6 * max(1.0, np.abs(e).max()), (k, np.abs(e - g).max())


@pytest.mark.parametrize("op", list(_GATES))
def test_batch_major_layout(op: str) -> None:
    """ORT's kernels refuse layout=1; unrolled, it equals layout 0 with X and the states transposed."""
    kw: dict[str, Any] = {"direction": "bidirectional", "lens": [4, 1, 3]}
    model, feeds = _model(op, layout=1, **kw)
    with pytest.raises(Exception, match="layout"):
        _run(model, feeds)
    time_major, feeds0 = _model(op, layout=0, **kw)
    expected = _run(time_major, feeds0)
    got = _run(_lowered(model), feeds)
    np.testing.assert_allclose(got[0], expected[0].transpose(2, 0, 1, 3), rtol=0, atol=2e-6)
    for e, g in zip(expected[1:], got[1:], strict=True):
        np.testing.assert_allclose(g, e.transpose(1, 0, 2), rtol=0, atol=2e-6)


class _Net(torch.nn.Module):
    """Two bidirectional batch-first layers and a linear head; the loss is the only output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(torch.nn, kind)(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: Any, target: Any) -> Any:
        out, _ = self.rnn(x)
        return ((self.head(out) - target) ** 2).mean()


@pytest.mark.parametrize("lowered", [False, True], ids=["rule", "lowered"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_torch_export_gradients_match_autograd(kind: str, lowered: bool) -> None:
    torch.manual_seed(0)
    net = _Net(kind)
    x, target = torch.randn(3, 5, 3), torch.randn(3, 5, 2)
    buffer = io.BytesIO()
    torch.onnx.export(net, (x, target), buffer, dynamo=False, opset_version=18, do_constant_folding=False,
                      input_names=["x", "target"], output_names=["loss"],
                      dynamic_axes={"x": {0: "batch"}, "target": {0: "batch"}})
    model: Any = onnx.load_from_string(buffer.getvalue())
    assert sum(n.op_type == kind for n in model.graph.node) == 2
    if lowered:
        model = ir.from_proto(onnx.shape_inference.infer_shapes(model))  # the unrolling reads the sequence length
        assert lower_recurrent(model.graph) == 2
    step = build_training_graph(model, optimizer=None)
    feeds = {"x": x.numpy(), "target": target.numpy()}
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), providers=["CPUExecutionProvider"])
    result = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))

    loss = net(x, target)
    loss.backward()
    assert abs(float(result["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
    params = dict(net.named_parameters())
    assert len(params) == 18  # 2 layers x 2 directions x (W_ih, W_hh, b_ih, b_hh) + the head
    for name, p in params.items():
        expected = p.grad.numpy()
        err = np.linalg.norm(result[f"grad/{name}"] - expected) / np.linalg.norm(expected)
        assert err <= 1e-4, (name, err)


def test_dynamic_sequence_length_is_refused() -> None:
    model, _ = _model("LSTM")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    model = onnx.shape_inference.infer_shapes(model)
    loss = helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)
    model.graph.node.append(loss)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    with pytest.raises(GradientError, match=r"LSTM node 'rec': the sequence length .* must be static"):
        build_training_graph(model, optimizer=None)


def _with_loss(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model`` with the single output ``loss = sum_k sum(out_k * c_k)``, fixed random ``c_k``."""
    rng = np.random.default_rng(4)
    outs = [o.name for o in model.graph.output]
    for k, (name, value) in enumerate(zip(outs, _run(model, feeds), strict=True)):
        model.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(value.shape).astype(np.float32), f"c{k}"))
        model.graph.node.extend([helper.make_node("Mul", [name, f"c{k}"], [f"p{k}"]),
                                 helper.make_node("ReduceSum", [f"p{k}"], [f"s{k}"], keepdims=0)])
    model.graph.node.append(helper.make_node("Sum", [f"s{k}" for k in range(len(outs))], ["loss"]))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return model, feeds


OPTION_CASES = [
    ("LSTM", {"direction": "bidirectional", "peepholes": True, "lens": [4, 2, 3], "attrs": {"clip": 1.5}}),
    ("LSTM", {"peepholes": True, "attrs": {"input_forget": 1}}),
    ("GRU", {"direction": "bidirectional", "attrs": {"linear_before_reset": 1, "activations": ["HardSigmoid", "Softsign", "LeakyRelu", "Tanh"],
                                                     "activation_alpha": [0.3, 0.2], "activation_beta": [0.6]}}),
    ("RNN", {"direction": "reverse", "lens": [1, 4, 3], "attrs": {"activations": ["Softsign"]}}),
]


@pytest.mark.parametrize(("op", "kw"), OPTION_CASES, ids=[f"{op}-{kw}" for op, kw in OPTION_CASES])
def test_option_gradients_match_finite_differences_of_the_kernel(op: str, kw: dict[str, Any]) -> None:
    """Options torch has no module for (peepholes, clip, input_forget, other activations): the
    gradient, by rule and lowered, against central differences of ONNX Runtime's own kernel."""
    model, feeds = _with_loss(*_model(op, **kw))
    rng = np.random.default_rng(5)
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == TensorProto.FLOAT and not i.name.startswith("c")}
    params["X"] = feeds["X"]

    grads = []
    for lowered in (False, True):
        source: Any = ir.from_proto(onnx.shape_inference.infer_shapes(model)) if lowered else model
        if lowered:
            lower_recurrent(source.graph)
        step = build_training_graph(source, optimizer=None, trainable_inputs=["X"])
        session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), providers=["CPUExecutionProvider"])
        result = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
        grads.append({n: result[f"grad/{n}"].astype(np.float64) for n in params})
    for n in params:
        np.testing.assert_allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6)

    direction = {n: rng.standard_normal(v.shape) for n, v in params.items()}
    eps = 1e-3

    def loss_at(sign: float) -> float:
        shifted = onnx.ModelProto()
        shifted.CopyFrom(model)
        for init in shifted.graph.initializer:
            if init.name in params:
                init.CopyFrom(numpy_helper.from_array((params[init.name] + sign * eps * direction[init.name]).astype(np.float32), init.name))
        x = (params["X"] + sign * eps * direction["X"]).astype(np.float32)
        return float(_run(shifted, {"X": x})[0])

    numeric = (loss_at(1.0) - loss_at(-1.0)) / (2 * eps)
    analytic = sum(float(np.vdot(grads[0][n], direction[n])) for n in params)
    assert abs(numeric - analytic) <= 1e-2 * max(1.0, abs(numeric)), (numeric, analytic)


@pytest.mark.parametrize("op", list(_GATES))
def test_rule_equals_lowering_without_the_builder(op: str) -> None:
    """``differentiate`` on a graph that keeps its recurrent node (the registered rule: recompute
    the unrolled form and differentiate it) gives the gradients of the lowered graph, whichever
    of the two the training-graph builder uses."""
    model, feeds = _with_loss(*_model(op, direction="bidirectional", lens=[3, 4, 1], peepholes=True))
    grads = []
    for lowered in (False, True):
        m = ir.from_proto(onnx.shape_inference.infer_shapes(model))
        if lowered:
            lower_recurrent(m.graph)
            onnx_ir.passes.common.ShapeInferencePass()(m)
        assert any(n.op_type == op for n in m.graph) != lowered
        wrt = [v for name, v in m.graph.initializers.items() if not name.startswith("c") and name != "L"]
        result = differentiate(m.graph, m.graph.outputs[0], wrt, opset=18)
        m.graph.outputs.extend(result[v.name or ""] for v in wrt)
        values = _run(ir.to_proto(m), feeds)[1:]
        grads.append(dict(zip([v.name for v in wrt], values, strict=True)))
    assert len(grads[0]) == (6 if op == "LSTM" else 4)  # W, R, B, H0 (, C0, P)
    for name, g in grads[0].items():
        np.testing.assert_allclose(g, grads[1][name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(("attrs", "message"), [
    ({"activations": ["Sigmoid", "Tanh", "Tanh"], "direction": "bidirectional"}, r"expected 6 activations \(3 per direction\)"),
    ({"activations": ["Sigmoid", "Gelu", "Tanh"]}, r"activation 'Gelu' has no unrolled form"),
])
def test_unsupported_attributes_are_refused(attrs: dict[str, Any], message: str) -> None:
    direction = attrs.pop("direction", "forward")
    model, _ = _model("LSTM", direction=direction, attrs=attrs)
    with pytest.raises(GradientError, match=rf"LSTM node 'rec': {message}"):
        lower_recurrent(ir.from_proto(model).graph)
