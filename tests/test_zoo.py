"""The committed model zoo (models/onnx) and the exporter that builds it (mpgraph.export).

Every zoo entry is checked in both variants (``<name>.onnx``, ``<name>.loss.onnx``):
the ONNX checker and strict shape inference accept it, ONNX Runtime (CPU) reproduces the
torch module at two batch sizes, parameters are distinct graph inputs with same-name fp32
initializers, and rebuilding it gives the committed bytes.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `models` is a folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from models.zoo import ZOO, export_zoo_model, zoo_filename  # noqa: E402
from mpgraph.export import BATCH_DIM, BatchNormLowering, ExportError, export_module  # noqa: E402

ONNX_DIR = ROOT / "models" / "onnx"
CASES = [(name, with_loss) for name in ZOO for with_loss in (False, True)]
CASE_IDS = [zoo_filename(name, with_loss) for name, with_loss in CASES]
BATCH_SIZES = (3, 5)
# ORT and torch pick different kernels (GEMM blocking, erf, softmax); fp32 agrees to ~1e-6.
RTOL = 1e-5
ATOL = 1e-5


@functools.cache
def committed_bytes(name: str, with_loss: bool) -> bytes:
    return (ONNX_DIR / zoo_filename(name, with_loss)).read_bytes()


@functools.cache
def committed(name: str, with_loss: bool) -> onnx.ModelProto:
    return onnx.load_from_string(committed_bytes(name, with_loss))


def session(model: onnx.ModelProto | bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ORT warns that initializers are also inputs: by design
    options.intra_op_num_threads = 1  # as torch (tests/conftest.py): one thread each
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


@functools.cache
def committed_session(name: str, with_loss: bool) -> ort.InferenceSession:
    return session(committed_bytes(name, with_loss))


def feeds(model: onnx.ModelProto, name: str, batch: int) -> dict[str, np.ndarray]:
    """Data inputs (and label) only: parameters come from the initializers."""
    entry = ZOO[name]
    data = {model.graph.input[0].name: entry.example_input(batch, seed=batch).numpy()}
    if model.graph.input[1].name == "label":
        data["label"] = entry.example_label(batch, seed=batch).numpy()
    return data


def torch_outputs(name: str, with_loss: bool, batch: int) -> list[np.ndarray]:
    """What the exported graph must compute, from a fresh seed-0 module in train mode."""
    entry = ZOO[name]
    module = entry.build()
    x = entry.example_input(batch, seed=batch)
    with torch.no_grad():
        logits = module(x)
        if not with_loss:
            return [logits.numpy()]
        label = entry.example_label(batch, seed=batch)
        if entry.loss == "cross_entropy":
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), label.reshape(-1)
            )
        else:
            loss = torch.nn.functional.mse_loss(logits, label)
    return [loss.numpy(), logits.numpy()]


def parameter_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {t.name for t in model.graph.initializer}
    return [value for value in model.graph.input if value.name in initializers]


@pytest.mark.parametrize(("name", "with_loss"), CASES, ids=CASE_IDS)
def test_checker_and_strict_shape_inference(name: str, with_loss: bool) -> None:
    model = committed(name, with_loss)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)
    assert model.ir_version <= 10
    opsets = {o.domain: o.version for o in model.opset_import}
    assert set(opsets) == {""}
    assert opsets[""] >= 18
    assert not model.functions


@pytest.mark.parametrize(("name", "with_loss"), CASES, ids=CASE_IDS)
def test_interface(name: str, with_loss: bool) -> None:
    model = committed(name, with_loss)
    entry = ZOO[name]
    inputs = [value.name for value in model.graph.input]
    outputs = [value.name for value in model.graph.output]
    params = [name for name, _ in entry.build().named_parameters()]
    data = ["tokens" if entry.vocab else "x", *(["label"] if with_loss else [])]
    assert inputs == [*data, *params]
    assert outputs == (["loss", "logits"] if with_loss else ["logits"])
    for value in [*model.graph.input[: len(data)], model.graph.output[-1]]:
        assert value.type.tensor_type.shape.dim[0].dim_param == BATCH_DIM, value.name
    if with_loss:
        assert not model.graph.output[0].type.tensor_type.shape.dim  # a scalar
        if entry.loss == "cross_entropy":
            assert "SoftmaxCrossEntropyLoss" in {node.op_type for node in model.graph.node}


@pytest.mark.parametrize(("name", "with_loss"), CASES, ids=CASE_IDS)
def test_parameters_are_inputs_with_same_name_initializers(name: str, with_loss: bool) -> None:
    model = committed(name, with_loss)
    module = ZOO[name].build()
    initializers = {t.name: t for t in model.graph.initializer}
    inputs = {value.name: value for value in model.graph.input}
    consumers: dict[str, int] = {}
    for node in model.graph.node:
        for tensor in node.input:
            consumers[tensor] = consumers.get(tensor, 0) + 1

    named = dict(module.named_parameters())
    # No two parameters merged into one: each is its own input, consumed under its own name.
    assert [value.name for value in parameter_inputs(model)] == list(named)
    for pname, param in named.items():
        assert inputs[pname].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        tensor = initializers[pname]
        assert tensor.data_type == onnx.TensorProto.FLOAT
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), param.detach().numpy())
        assert consumers.get(pname), f"{pname} is not used by any node"
    # Buffers are constants (initializers that are not inputs), under their torch names.
    for bname, buffer in module.named_buffers():
        if bname in initializers:
            assert bname not in inputs
            np.testing.assert_array_equal(
                onnx.numpy_helper.to_array(initializers[bname]), buffer.numpy()
            )


@pytest.mark.parametrize(("name", "with_loss"), CASES, ids=CASE_IDS)
def test_ort_matches_torch_at_two_batch_sizes(name: str, with_loss: bool) -> None:
    model = committed(name, with_loss)
    sess = committed_session(name, with_loss)
    for batch in BATCH_SIZES:
        actual = sess.run(None, feeds(model, name, batch))
        expected = torch_outputs(name, with_loss, batch)
        assert [a.shape for a in actual] == [e.shape for e in expected]
        for got, want in zip(actual, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"batch {batch}")


def test_gpt_layernorms_keep_distinct_parameters() -> None:
    """Fresh LayerNorm weights are equal; the dynamo exporter would merge them as constants."""
    model = committed("gpt", False)
    scales = [node.input[1] for node in model.graph.node if node.op_type == "LayerNormalization"]
    assert scales == [
        "blocks.0.ln1.weight",
        "blocks.0.ln2.weight",
        "blocks.1.ln1.weight",
        "blocks.1.ln2.weight",
        "ln_f.weight",
    ]


def test_resnet_batchnorm_uses_batch_statistics() -> None:
    model = committed("resnet", False)
    batch_norms = [node for node in model.graph.node if node.op_type == "BatchNormalization"]
    assert len(batch_norms) == 9
    initializers = {t.name for t in model.graph.initializer}
    for node in batch_norms:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes.get("training_mode") == 1, node.name
        # The running statistics stay, under their buffer names, for train_graph's state.
        assert node.input[3].endswith(".running_mean") and node.input[3] in initializers
        assert node.input[4].endswith(".running_var") and node.input[4] in initializers
    entry = ZOO["resnet"]
    x = entry.example_input(5, seed=5)
    (actual,) = committed_session("resnet", False).run(None, {"x": x.numpy()})
    module = entry.build()
    with torch.no_grad():
        train = module.train()(x).numpy()
        evaluation = module.eval()(x).numpy()
    np.testing.assert_allclose(actual, train, rtol=RTOL, atol=ATOL)
    assert not np.allclose(actual, evaluation, rtol=1e-3, atol=1e-3)  # the check has teeth


class _BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.bn_plain = torch.nn.BatchNorm2d(4, affine=False)
        self.bn_stateless = torch.nn.BatchNorm1d(4, track_running_stats=False)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_plain(self.bn(self.conv(x))))
        return self.fc(self.bn_stateless(x.mean(dim=(2, 3))))


@pytest.mark.parametrize(
    ("train", "lowering"),
    [(True, "node"), (True, "ops"), (False, "node")],
    ids=["train-node", "train-ops", "eval"],
)
def test_export_batchnorm_follows_module_mode(train: bool, lowering: BatchNormLowering) -> None:
    """Non-trivial running statistics make train and eval mode disagree; each must match."""
    torch.manual_seed(0)
    module = _BatchNormNet()
    for bn in (module.bn, module.bn_plain):
        assert bn.running_mean is not None and bn.running_var is not None
        bn.running_mean.uniform_(-1.0, 1.0)
        bn.running_var.uniform_(0.5, 2.0)
    module.train(train)
    before = copy.deepcopy(module.state_dict())
    model = export_module(module, torch.randn(2, 3, 8, 8), loss="mse", batch_norm=lowering)
    for key, value in module.state_dict().items():  # exporting must not touch the buffers
        assert torch.equal(value, before[key]), key
    x, label = torch.randn(5, 3, 8, 8), torch.randn(5, 2)
    loss, logits = session(model).run(None, {"x": x.numpy(), "label": label.numpy()})
    with torch.no_grad():
        expected = copy.deepcopy(module)(x)
    np.testing.assert_allclose(logits, expected.numpy(), rtol=RTOL, atol=ATOL)
    expected_loss = torch.nn.functional.mse_loss(expected, label)
    np.testing.assert_allclose(loss, expected_loss.numpy(), rtol=RTOL)
    modes = [
        next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        for node in model.graph.node
        if node.op_type == "BatchNormalization"
    ]
    # bn_stateless has no running statistics: torch uses batch statistics even in eval mode.
    expected = {(True, "node"): [1, 1, 1], (True, "ops"): [], (False, "node"): [0, 0, 1]}
    assert modes == expected[train, lowering]
    initializers = {t.name for t in model.graph.initializer}
    running = {"bn.running_mean", "bn.running_var", "bn_plain.running_mean", "bn_plain.running_var"}
    # BatchNormalization nodes read the running statistics: constants named after the buffers.
    assert (running <= initializers) == (lowering == "node")


def test_export_errors_are_mpgraph_errors() -> None:
    module = ZOO["tiny_mlp"].build()
    x = torch.randn(2, 4)
    with pytest.raises(ExportError, match="unknown loss 'hinge'"):
        export_module(module, x, loss="hinge")  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="unknown batch_norm 'fused'"):
        export_module(module, x, batch_norm="fused")  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="opset 17"):
        export_module(module, x, opset=17)
    with pytest.raises(ExportError, match="batch dimension of size >= 2"):
        export_module(module, torch.randn(1, 4))
    with pytest.raises(ExportError, match="example inputs"):
        export_module(module, x, input_names=["a", "b"])

    class TwoOutputs(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(ExportError, match="must return one tensor"):
        export_module(TwoOutputs(), x)
    with pytest.raises(ExportError, match="forward fails on the example inputs"):
        export_module(module, torch.randn(2, 5))

    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(ExportError, match="torch.export failed"):
        export_module(DataDependent(), x)


def test_export_writes_the_returned_model(tmp_path: Path) -> None:
    path = tmp_path / "tiny.onnx"
    model = export_module(ZOO["tiny_mlp"].build(), torch.randn(2, 4), path, loss="cross_entropy")
    assert onnx.load(path) == model


@pytest.mark.parametrize(("name", "with_loss"), CASES, ids=CASE_IDS)
def test_rebuild_matches_committed(name: str, with_loss: bool) -> None:
    """Byte-identical with the torch that built the zoo; numerically equal with another one."""
    rebuilt = export_zoo_model(name, with_loss)
    model = committed(name, with_loss)
    if rebuilt.producer_version == model.producer_version:
        assert rebuilt.SerializeToString(deterministic=True) == committed_bytes(name, with_loss)
        return
    sess = session(rebuilt)
    for batch in BATCH_SIZES:
        data = feeds(model, name, batch)
        expected = committed_session(name, with_loss).run(None, data)
        for got, want in zip(sess.run(None, data), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
