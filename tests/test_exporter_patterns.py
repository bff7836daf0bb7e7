"""What real exporters do to a model, and how train-graph undoes it (issue 12).

Models come from ``transformers`` configs with random init (no downloads) and are exported once
per module. The TorchScript exporter (``dynamo=False``) deduplicates equal-valued initializers
and brings the dropped ones back as ``Identity`` nodes named after them: every LayerNorm weight
of GPT-2 is one tensor, every BatchNorm scale and running variance of a ResNet another.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mpgraph._ir.meta import MODEL_STATE_PAIRS
from mpgraph.errors import UnsupportedModelError
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


class _WithLoss(torch.nn.Module):
    """The model with its cross-entropy loss as the only output, as a user would export it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x, label):
        logits = self.m(x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), label.flatten())


def _export(module: torch.nn.Module, args: tuple, path: Path, names: list[str]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=18, do_constant_folding=False,
                          input_names=names, output_names=["loss"],
                          dynamic_axes={n: {0: "batch"} for n in names})
    return path


def _session(model: ir.Model, level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.graph_optimization_level = level
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _identity_named(path: Path) -> set[str]:
    """Outputs of Identity nodes whose input is an initializer: the dropped duplicates."""
    proto = onnx.load(str(path))
    inits = {t.name for t in proto.graph.initializer}
    return {n.output[0] for n in proto.graph.node if n.op_type == "Identity" and n.input[0] in inits}


@pytest.fixture(scope="module")
def hf_resnet(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    module = _WithLoss(transformers.ResNetForImageClassification(config)).train()
    x, label = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    path = _export(module, (x, label), tmp_path_factory.mktemp("resnet") / "resnet.onnx", ["x", "label"])
    return module, path, x, label


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    module = _WithLoss(transformers.GPT2LMHeadModel(config)).eval()
    tokens, label = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    path = _export(module, (tokens, label), tmp_path_factory.mktemp("gpt2") / "gpt2.onnx", ["tokens", "label"])
    return module, path, tokens, label


# ---------------------------------------------------------------------------------------------
# BatchNorm in a deduplicated ResNet export
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batchnorm", ["train", "train-ops"])
def test_deduplicated_resnet_batchnorm_matches_torch_train_mode(hf_resnet, batchnorm: str) -> None:
    module, path, x, label = hf_resnet
    dropped = _identity_named(path)
    assert any(n.endswith("running_var") for n in dropped), "the export no longer deduplicates: test is moot"
    reference = copy.deepcopy(module).train()
    loss = reference(x, label)
    loss.backward()
    step = build_training_graph(path, optimizer=None, batchnorm=batchnorm)
    feeds = {"x": x.numpy(), "label": label.numpy()}
    # Both ORT levels: unused running-statistic outputs went wrong only under its optimizations.
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        session = _session(step, level)
        names = [o.name for o in session.get_outputs()]
        out = dict(zip(names, session.run(None, feeds)))
        assert abs(float(out["loss"]) - loss.item()) <= 1e-5, (level, float(out["loss"]), loss.item())
    for name, param in reference.named_parameters():
        assert _rel(out[f"grad/{name}"], param.grad.numpy()) <= 1e-4, name
    # Every BatchNorm has its own running statistics as state, updated like torch's mean.
    for name, buffer in reference.named_buffers():
        if name.endswith("running_mean"):
            np.testing.assert_allclose(out[f"{name}/updated"], buffer.numpy(), atol=1e-6, err_msg=name)
        if name.endswith("running_var"):
            assert f"{name}/updated" in out


def test_running_statistics_never_alias_a_parameter() -> None:
    """A running mean that is the bias tensor itself (no Identity) gets its own state."""
    rng = np.random.default_rng(0)
    nh = onnx.helper
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "scale"),
             onnx.numpy_helper.from_array(np.zeros(3, np.float32), "bias"),
             onnx.numpy_helper.from_array(np.ones(3, np.float32), "var")]
    node = nh.make_node("BatchNormalization", ["x", "scale", "bias", "bias", "var"], ["y"], name="bn")
    sq = nh.make_node("Mul", ["y", "y"], ["y2"], name="sq")
    loss = nh.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0, name="sum")
    graph = nh.make_graph([node, sq, loss], "g", [nh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 4])],
                          [nh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], inits)
    model = nh.make_model(graph, opset_imports=[nh.make_opsetid("", 18)])
    step = build_training_graph(model, optimizer="sgd", lr=0.5)
    pairs = dict(json.loads(step.metadata_props[MODEL_STATE_PAIRS]))
    assert "bias" in pairs and "bn/running_mean" in pairs
    x = rng.standard_normal((5, 3, 4)).astype(np.float32)
    runner = CpuRunner(step)
    runner.step({"x": x})
    mean = x.mean(axis=(0, 2))
    np.testing.assert_allclose(runner.state["bn/running_mean"], 0.1 * mean, rtol=1e-5, atol=1e-7)
    # y is normalized to zero mean per channel, so the bias gradient is 2 * sum(y) = 0.
    np.testing.assert_allclose(runner.state["bias"], 0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Deduplicated parameters are separate; tied ones stay tied
# ---------------------------------------------------------------------------------------------


def test_deduplicated_gpt2_layernorms_are_separate_parameters(gpt2) -> None:
    module, path, tokens, label = gpt2
    dropped = _identity_named(path)
    assert "m.transformer.h.1.ln_1.weight" in dropped, "the export no longer deduplicates: test is moot"
    reference = copy.deepcopy(module)
    reference(tokens, label).backward()
    step = build_training_graph(path, optimizer=None)
    session = _session(step)
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"tokens": tokens.numpy(), "label": label.numpy()})))
    grads = {n[len("grad/"):] for n in out if n.startswith("grad/")}
    params = dict(reference.named_parameters())
    # One gradient per torch parameter: the LayerNorm weights are apart, wte and lm_head stay one.
    assert grads == set(params), (grads ^ set(params))
    worst = max(_rel(out[f"grad/{n}"], p.grad.numpy()) for n, p in params.items())
    assert worst <= 1e-4, worst


def test_untied_parameters_train_apart(gpt2) -> None:
    _, path, tokens, label = gpt2
    step = build_training_graph(path, optimizer="adamw", lr=1e-2)
    runner = CpuRunner(step)
    runner.step({"tokens": tokens.numpy(), "label": label.numpy()})
    a, b = runner.state["m.transformer.h.0.ln_1.weight"], runner.state["m.transformer.h.1.ln_1.weight"]
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# The dynamo exporter folds BatchNorm into convolutions, even in train mode
# ---------------------------------------------------------------------------------------------


class _ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x, label):
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return torch.nn.functional.cross_entropy(self.fc(h), label)


def test_dynamo_folded_batchnorm_is_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture, hf_resnet) -> None:
    torch.manual_seed(0)
    module = _ConvBN().train()
    args = (torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, opset_version=18,
                                    training=torch.onnx.TrainingMode.TRAINING)
    proto = program.model_proto
    assert not any(n.op_type == "BatchNormalization" for n in proto.graph.node), "dynamo kept the BatchNorm: test is moot"
    # The fused conv weight is a new tensor under the old name: the step graph is refused.
    with (caplog.at_level("WARNING", logger="mpgraph.training"),
          pytest.raises(UnsupportedModelError, match=r"first: 'conv\.weight', dropped or rewritten by .*FuseBatchNormIntoConv")):
        build_training_graph(proto, optimizer=None)
    folded = [r.getMessage() for r in caplog.records if "folded into the preceding convolution" in r.getMessage()]
    assert len(folded) == 1 and "dynamo=False" in folded[0] and "\n" not in folded[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="mpgraph.training"):  # TorchScript keeps its BatchNorms
        build_training_graph(hf_resnet[1], optimizer=None)
    assert not any("folded" in r.getMessage() for r in caplog.records)
