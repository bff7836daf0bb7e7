"""Training step graphs: zoo gradients and optimizer trajectories against torch, real ONNX
models from the onnx wheel against finite differences, and bad input.

Run: ``pytest tests/test_train_graph.py -q -s`` (``-s`` shows the outcome summary).
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import sys
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mpgraph._ir.meta import MODEL_STATE_PAIRS, MODEL_TRAINING, NODE_ROLE, ROLES
from mpgraph.errors import GradientError, MpgraphError
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ZOO_DIR = ROOT / "models" / "onnx"
ZOO_NAMES = ["tiny_mlp", "wide_mlp", "dqn_cnn", "gpt", "resnet"]
ONNX_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"

torch = pytest.importorskip("torch")


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _zoo(name: str):
    if not (ZOO_DIR / f"{name}.loss.onnx").exists():
        pytest.skip(f"zoo model {name}.loss.onnx not built")
    from models.zoo import ZOO

    return ZOO[name]


def _torch_loss(entry, logits, label):
    functional = torch.nn.functional
    if entry.loss == "cross_entropy":
        return functional.cross_entropy(logits.flatten(0, -2), label.flatten())
    return functional.mse_loss(logits, label)


def _feeds(session: ort.InferenceSession, x, label) -> dict[str, np.ndarray]:
    data = next(i.name for i in session.get_inputs() if i.name in ("x", "tokens"))
    return {data: x.numpy(), "label": label.numpy()}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------
# Zoo: gradients and optimizers against torch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_gradients_match_torch(name: str) -> None:
    entry = _zoo(name)
    step = build_training_graph(ZOO_DIR / f"{name}.loss.onnx", optimizer=None)
    session = _session(step)
    for batch in (3, 5):  # one graph, two batch sizes: the batch dim stays dynamic
        module = entry.build()
        x, label = entry.example_input(batch), entry.example_label(batch)
        loss = _torch_loss(entry, module(x), label)
        loss.backward()
        outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, _feeds(session, x, label)), strict=True))
        assert abs(float(outs["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
        for pname, p in module.named_parameters():
            assert _rel(outs[f"grad/{pname}"], p.grad.numpy()) <= 1e-5, (name, batch, pname)


@pytest.mark.parametrize("opset", [23, 24])
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_zoo_gradients_match_torch_at_newer_opsets(name: str, opset: int) -> None:
    """Models at opset 23/24 (ir_version 11/12, which ORT loads) train like their opset-18 twins."""
    from onnx import version_converter

    entry = _zoo(name)
    upgraded = version_converter.convert_version(onnx.load(ZOO_DIR / f"{name}.loss.onnx"), opset)
    upgraded.ir_version = onnx.helper.find_min_ir_version_for(list(upgraded.opset_import), True)
    step = build_training_graph(upgraded, optimizer=None)
    assert step.opset_imports[""] == opset and step.ir_version == {23: 11, 24: 12}[opset]
    session = _session(step)
    module = entry.build()
    x, label = entry.example_input(3), entry.example_label(3)
    _torch_loss(entry, module(x), label).backward()
    outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, _feeds(session, x, label)), strict=True))
    for pname, p in module.named_parameters():
        assert _rel(outs[f"grad/{pname}"], p.grad.numpy()) <= 1e-5, (name, opset, pname)


OPTIMIZERS = {
    "sgd": dict(momentum=0.9, weight_decay=1e-4),
    "adam": dict(beta1=0.9, beta2=0.999, eps=1e-8),
    "adamw": dict(weight_decay=1e-2),
}
DEFAULT_RATES = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
# The reference trajectory is torch.optim run in float64: fp32 torch is not exact either (after
# one SGD step of the ResNet its BatchNorm-bias gradient is 1.6e-3 off the float64 value, ours
# 9e-7). fp32 trajectories of ReLU nets are chaotic: a rounding-level difference that flips a
# ReLU (or, for Adam, moves a gradient component near eps) is amplified step after step, and
# whether such an event happens depends on the learning rate erratically (dqn_cnn, AdamW:
# fp32 torch is 1.9e-6 off at 2e-4, 1.0e-3 at 5e-5, 1.7e-6 at 1e-5, relative to the weights).
# At the rates below ours stays on the float64 trajectory (TRACK_BOUND, after TUNED_STEPS; after
# 50 steps each model's worst case was at most 3.1x further, the DQN's); at default rates some
# runs leave it, and so do fp32 torch runs (the default-rate test).
LEARNING_RATES = {"sgd": 1e-2, "adam": 1e-4, "adamw": 1e-4}
LR_OVERRIDES = {
    ("resnet", "sgd"): 3e-4, ("resnet", "adam"): 3e-5, ("resnet", "adamw"): 3e-5,
    ("wide_mlp", "adam"): 5e-5, ("wide_mlp", "adamw"): 1e-5, ("dqn_cnn", "adamw"): 2e-4,
}


def _torch_optimizer(kind: str, params, options: dict, lr: float, fused: bool = False):
    """torch.optim's optimizer; ``fused``: its fused CPU kernel instead of the per-tensor loop
    (torch's CPU default). For the float64 reference: the same update to float64 rounding, and
    measured 9x faster there (Adam on the DQN's 1.7 M parameters: 2.9 against 26 ms a step,
    most of a float64 step's time)."""
    mode = {"fused": True} if fused else {"foreach": False}
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=options.get("momentum", 0.0),
                               dampening=options.get("dampening", 0.0), nesterov=options.get("nesterov", False),
                               weight_decay=options.get("weight_decay", 0.0), **mode)
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=(options.get("beta1", 0.9), options.get("beta2", 0.999)),
               eps=options.get("eps", 1e-8), weight_decay=options.get("weight_decay", 0.0 if kind == "adam" else 1e-2),
               amsgrad=options.get("amsgrad", False), **mode)


def _flat(values) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in values])


def _as(value, dtype):
    return value.to(dtype) if value.is_floating_point() else value


def _perturbed(module, seed: int):
    """``module`` with every weight moved by about one fp32 rounding (relative 1e-7)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=generator))
    return module


@functools.lru_cache(maxsize=16)
def _step_graph(name: str, kind: str, options: str, lr: float) -> ir.Model:
    """The step graph of zoo model ``name`` (``options`` as JSON), built once per process: the
    one-step and the default-rate tests train the same graph, and CpuRunner only reads it."""
    return build_training_graph(ZOO_DIR / f"{name}.loss.onnx", optimizer=kind, optimizer_options=json.loads(options), lr=lr)


@functools.cache
def _batches(name: str, batch: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    entry = _zoo(name)
    return tuple((entry.example_input(batch, seed=s), entry.example_label(batch, seed=s)) for s in range(4))


def _train_torch(name: str, module, kind: str, options: dict, lr: float, steps: int, batch: int,
                 dtype: torch.dtype, on_loss: Callable[[int, float], None] | None = None):
    """``module`` after ``steps`` torch.optim steps in ``dtype`` on ``_track``'s batches."""
    entry = _zoo(name)
    opt = _torch_optimizer(kind, module.parameters(), options, lr, fused=dtype == torch.float64)
    batches = _batches(name, batch)
    for i in range(steps):
        x, label = batches[i % len(batches)]
        opt.zero_grad()
        loss = _torch_loss(entry, module(_as(x, dtype)), _as(label, dtype))
        loss.backward()
        opt.step()
        if on_loss is not None:
            on_loss(i, loss.item())
    return module


def _track(name: str, kind: str, options: dict, lr: float, steps: int = 50, batch: int = 8,
           check_loss: bool = True) -> tuple[float, Iterator[float]]:
    """Run ``steps`` steps in ORT (fp32) and in torch.optim (float64) on the same batches.
    Returns the error of all parameters (concatenated) at the end against the float64 torch
    run, relative to the float64 run's total update ``||p_end - p_start||`` (relative to the
    parameters themselves, an error could hide in the part that training never moves); and
    the same error of fp32 torch runs (the scale of fp32 rounding noise after ``steps``
    steps), each run when the iterator reaches it: the first from the same weights, the
    next ones from weights moved by rounding-level noise (``_perturbed``, seeds 1, 2, ...)."""
    entry = _zoo(name)
    step = _step_graph(name, kind, json.dumps(options, sort_keys=True), lr)
    runner = CpuRunner(step, threads=1, spin=False)
    data = "tokens" if entry.vocab else "x"
    batches = _batches(name, batch)
    losses = []
    for i in range(steps):
        x, label = batches[i % len(batches)]
        # Odd steps pass lr at run time, even steps use the graph's default: both must agree.
        losses.append(runner.step({data: x.numpy(), "label": label.numpy()}, lr=lr if i % 2 else None))

    def same_loss(i: int, loss: float) -> None:
        assert abs(losses[i] - loss) <= 1e-4 * max(1.0, abs(loss)), (name, kind, i)

    reference = entry.build().double()
    start = _flat(p.detach().numpy() for p in reference.parameters())
    _train_torch(name, reference, kind, options, lr, steps, batch, torch.float64, same_loss if check_loss else None)
    state = runner.state
    names = [n for n, _ in reference.named_parameters()]
    expected = _flat(p.detach().numpy() for p in reference.parameters())
    update = max(float(np.linalg.norm(expected - start)), 1e-30)
    ours = float(np.linalg.norm(_flat(state[n] for n in names) - expected)) / update
    # Running means are averages of near-zero-mean activations: small norms make their
    # relative error larger than the parameters'. Running variances are updated with the
    # unbiased batch variance, as torch does (the zoo's models are torch exports).
    if check_loss:
        for bname, buf in reference.named_buffers():
            if bname.endswith(("running_mean", "running_var")):
                assert _rel(state[bname], buf.numpy()) <= 1e-3, (name, bname)

    def fp32_runs() -> Iterator[float]:
        for seed in itertools.count():
            module = entry.build() if seed == 0 else _perturbed(entry.build(), seed)
            _train_torch(name, module, kind, options, lr, steps, batch, torch.float32)
            yield float(np.linalg.norm(_flat(p.detach().numpy() for p in module.parameters()) - expected)) / update

    return ours, fp32_runs()


# Steps at LEARNING_RATES. A wrong update (bias correction, decay, momentum, a state not carried)
# leaves the trajectory within a few steps; the default-rate test keeps its 50 steps, which
# its fp32-noise criterion needs (at 25 the DQN's Adam run is 5x the furthest fp32 torch run,
# at 50 within 2x: the noise takes longer to grow than ours).
TUNED_STEPS = 25
# Error relative to the float64 update (``_track``), per model, after TUNED_STEPS: at least 3x
# the worst of the three optimizers, measured (ORT 1.32 CPU, 1 thread) in the comment.
TRACK_BOUND = {
    "tiny_mlp": 2e-4,  # adamw 5.9e-5
    "wide_mlp": 4e-4,  # adamw 1.2e-4
    "dqn_cnn": 1e-4,  # sgd 7.1e-6
    "gpt": 5e-4,  # adamw 1.7e-4
    "resnet": 5e-3,  # adam 8.4e-4 (BatchNorm: a mean over the batch amplifies rounding)
}
# One step at DEFAULT_RATES:
ONE_STEP_BOUND = {
    "tiny_mlp": 2e-5,  # adamw 4.3e-6
    "wide_mlp": 5e-5,  # adam 1.6e-5
    "dqn_cnn": 1e-4,  # adam 3.6e-5
    "gpt": 7e-4,  # adam 2.4e-4 (Adam's first step is g/|g|: near-zero components round either way)
    "resnet": 1e-4,  # adam 3.1e-5
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_optimizer_tracks_torch(name: str, kind: str) -> None:
    lr = LR_OVERRIDES.get((name, kind), LEARNING_RATES[kind])
    assert _track(name, kind, OPTIMIZERS[kind], lr, steps=TUNED_STEPS)[0] <= TRACK_BOUND[name]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "name", [n if n in ("tiny_mlp", "gpt") else pytest.param(n, marks=pytest.mark.slow) for n in ZOO_NAMES]
)
def test_zoo_default_rate_tracks_torch_within_fp32_noise(name: str, kind: str) -> None:
    """50 steps at default learning rates: within 1e-4 of float64 torch.optim, or, where fp32
    rounding noise alone carries fp32 torch further, no further than twice the furthest of four
    fp32 torch runs (one from the same weights, three from weights moved by ~1 rounding).
    Measured (relative to the update): dqn_cnn Adam ours 3.2e-2, furthest fp32 torch 1.7e-2;
    ResNet SGD ours 1.4e-2, torch 0.16; the MLPs and the GPT stay under 1.2e-4.
    wide_mlp, dqn_cnn and ResNet are marked slow: 1.5-4.5 s of CPU each."""
    ours, fp32_runs = _track(name, kind, OPTIMIZERS[kind], DEFAULT_RATES[kind], check_loss=False)
    # An fp32 run is made only while ours exceeds the bound of the runs made so far (none where
    # ours is under 1e-4): the verdict is that of all four, at a fraction of their cost.
    theirs: list[float] = []
    runs = itertools.islice(fp32_runs, 4)
    while ours > max(1e-4, 2 * max(theirs, default=0.0)) and (error := next(runs, None)) is not None:
        theirs.append(error)
    assert ours <= max(1e-4, 2 * max(theirs, default=0.0)), (ours, theirs)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_one_step_at_default_rate_matches_torch(name: str, kind: str) -> None:
    ours, _ = _track(name, kind, OPTIMIZERS[kind], DEFAULT_RATES[kind], steps=1)
    assert ours <= ONE_STEP_BOUND[name]


@pytest.mark.parametrize(
    "options",
    [dict(momentum=0.9, nesterov=True, weight_decay=1e-3), dict(momentum=0.5, dampening=0.3), dict()],
    ids=["nesterov", "dampening", "plain"],
)
def test_sgd_variants_track_torch(options: dict) -> None:
    assert _track("tiny_mlp", "sgd", options, 0.1, steps=20)[0] <= 1e-5  # measured <= 2.6e-6 (plain)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_unpacked_optimizer_tracks_torch(kind: str) -> None:
    options = {**OPTIMIZERS[kind], "pack": False}
    assert _track("tiny_mlp", kind, options, LEARNING_RATES[kind], steps=20)[0] <= 2e-4  # measured <= 5.9e-5 (adamw)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("name", ["tiny_mlp", "gpt"])
def test_amsgrad_tracks_torch(name: str, kind: str) -> None:
    _zoo(name)
    step = build_training_graph(ZOO_DIR / f"{name}.loss.onnx", optimizer=kind, optimizer_options={"amsgrad": True})
    assert any(a.endswith("/v_max") for a, _ in json.loads(step.metadata_props[MODEL_STATE_PAIRS]))
    # beta2 = 0.9 lets the second moment fall between batches, so its running maximum matters:
    # the same run without amsgrad in our graph leaves torch's loss by more than 1e-4 by step 5.
    bound = {"tiny_mlp": 5e-5, "gpt": 4e-4}[name]  # measured <= 5.2e-6, 1.3e-4
    assert _track(name, kind, {**OPTIMIZERS[kind], "beta2": 0.9, "amsgrad": True}, 1e-3, steps=30)[0] <= bound


def test_adam_weight_decay_tracks_torch() -> None:
    assert _track("tiny_mlp", "adam", dict(weight_decay=1e-2), 1e-3, steps=20)[0] <= 1e-5  # measured 8.5e-7


def test_step_graph_structure() -> None:
    _zoo("resnet")
    step = build_training_graph(ZOO_DIR / "resnet.loss.onnx", optimizer="adamw")
    proto = ir.to_proto(step)
    assert proto.ir_version <= 10
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    assert step.metadata_props[MODEL_TRAINING] == "true"
    pairs = json.loads(step.metadata_props[MODEL_STATE_PAIRS])
    inputs = {v.name: v for v in step.graph.inputs}
    outputs = {v.name for v in step.graph.outputs}
    for state_in, state_out in pairs:
        assert state_in in inputs and state_out in outputs
        assert inputs[state_in].dtype == ir.DataType.FLOAT
    names = {a for a, _ in pairs}
    # Small parameters (all of this ResNet's) are updated as one flat vector.
    assert {"optim/step", "fc.weight", "optim/flat/m", "optim/flat/v", "bn.running_mean"} <= names
    unpacked = build_training_graph(ZOO_DIR / "resnet.loss.onnx", optimizer="adamw", optimizer_options={"pack": False})
    assert "optim/fc.weight/m" in {a for a, _ in json.loads(unpacked.metadata_props[MODEL_STATE_PAIRS])}
    assert inputs["lr"].shape == ir.Shape([])
    assert [v.name for v in step.graph.outputs][0] == "loss"
    roles = {n.metadata_props.get(NODE_ROLE) for n in step.graph}
    assert roles == set(ROLES)
    assert all(n.name for n in step.graph)
    assert len({n.name for n in step.graph}) == len(step.graph)
    assert all(n.name.startswith("grad/") for n in step.graph if n.metadata_props[NODE_ROLE] == "backward")
    assert str(step.graph.inputs[0].shape[0]) == "batch"


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_attached_builtin_loss_matches_exported_loss(name: str) -> None:
    """The forward-only zoo model with the built-in loss gives the exported loss's gradients."""
    entry = _zoo(name)
    if not (ZOO_DIR / f"{name}.onnx").exists():
        pytest.skip("forward model missing")
    ours = _session(build_training_graph(ZOO_DIR / f"{name}.onnx", optimizer=None, loss=entry.loss))
    theirs = _session(build_training_graph(ZOO_DIR / f"{name}.loss.onnx", optimizer=None))
    x, label = entry.example_input(3), entry.example_label(3)
    a = dict(zip([o.name for o in ours.get_outputs()], ours.run(None, _feeds(ours, x, label)), strict=True))
    b = dict(zip([o.name for o in theirs.get_outputs()], theirs.run(None, _feeds(theirs, x, label)), strict=True))
    assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-6 * max(1.0, abs(float(b["loss"])))
    for key, value in b.items():
        if key.startswith("grad/"):
            assert _rel(a[key], value) <= 1e-5, key


def test_mlp_backward_has_no_transpose() -> None:
    _zoo("wide_mlp")
    step = build_training_graph(ZOO_DIR / "wide_mlp.loss.onnx", optimizer="sgd")
    assert not [n for n in step.graph if n.op_type == "Transpose"]


def test_freeze_keeps_parameters_fixed() -> None:
    _zoo("tiny_mlp")
    step = build_training_graph(ZOO_DIR / "tiny_mlp.loss.onnx", optimizer="sgd", freeze=["fc1.*"])
    pairs = dict(json.loads(step.metadata_props[MODEL_STATE_PAIRS]))
    assert "fc1.weight" not in pairs and "fc2.weight" in pairs
    assert "fc1.weight" not in {v.name for v in step.graph.inputs}


def test_build_is_deterministic() -> None:
    _zoo("gpt")
    a = ir.to_proto(build_training_graph(ZOO_DIR / "gpt.loss.onnx")).SerializeToString()
    b = ir.to_proto(build_training_graph(ZOO_DIR / "gpt.loss.onnx")).SerializeToString()
    assert a == b


# ---------------------------------------------------------------------------------------------
# Bad input: one-line GradientError
# ---------------------------------------------------------------------------------------------


def _tiny(op: str = "Relu", dtype: int = onnx.TensorProto.FLOAT, output: str = "y") -> onnx.ModelProto:
    helper = onnx.helper
    w = onnx.numpy_helper.from_array(np.ones((3, 3), dtype=onnx.helper.tensor_dtype_to_np_dtype(dtype)), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node(op, ["h"], [output], name="act")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, ["N", 3])],
                              [helper.make_tensor_value_info(output, dtype, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize(
    ("model", "kwargs", "needle"),
    [
        (_tiny(), {}, "no loss"),
        (_tiny(), {"loss": "hinge"}, "unknown loss"),
        (_tiny(dtype=onnx.TensorProto.INT64), {"loss": "y"}, "not a float"),
        (_tiny(op="Acos"), {"loss": "mse"}, "Acos"),
        (_tiny(), {"loss": "mse", "freeze": ["nomatch*"]}, "nomatch*"),
        (_tiny(), {"loss": "mse", "freeze": ["w"]}, "nothing to train"),
        (_tiny(), {"loss": "mse", "optimizer": "lion"}, "unknown optimizer"),
    ],
    ids=["no-loss", "bad-loss", "integer-graph", "unsupported-op", "bad-freeze", "all-frozen", "bad-optimizer"],
)
def test_bad_input_raises_one_line_gradient_error(model, kwargs, needle) -> None:
    with pytest.raises(GradientError) as info:
        build_training_graph(model, **kwargs)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_unsupported_op_error_names_op_opset_and_node() -> None:
    with pytest.raises(GradientError, match=r"Acos at opset 18 \(node 'act'"):
        build_training_graph(_tiny(op="Acos"), loss="mse")


def _scalar_loss_model(names: tuple[str, ...] = ("233",), opset: int = 18) -> onnx.ModelProto:
    """MatMul then one float-scalar ReduceMean output per name (exporters number the loss)."""
    helper = onnx.helper
    w = onnx.numpy_helper.from_array(np.full((3, 3), 0.5, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
    nodes += [helper.make_node("ReduceMean", ["h"], [n], keepdims=0, name=f"mean{i}") for i, n in enumerate(names)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, []) for n in names], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_only_float_scalar_output_is_the_loss() -> None:
    step = build_training_graph(_scalar_loss_model(("233",)), optimizer="sgd")
    assert step.graph.outputs[0].name == "233" and step.metadata_props["mpgraph.loss"] == "233"


def test_several_outputs_error_speaks_cli() -> None:
    with pytest.raises(GradientError) as info:
        build_training_graph(_scalar_loss_model(("a", "b")))
    message = str(info.value)
    assert "--loss NAME" in message and "--loss cross_entropy" in message and "--loss mse" in message
    assert "a float[]" in message and "b float[]" in message and "loss=" not in message and "\n" not in message


def test_errors_name_the_models_own_opset() -> None:
    model = _tiny(op="Acos")
    model.opset_import[0].version = 13
    with pytest.raises(GradientError, match=r"Acos at opset 13 \(upgraded to 18\) \(node 'act'"):
        build_training_graph(model, loss="mse")


def test_constant_subgraphs_fold_but_parameters_stay() -> None:
    """Reduce axes and Pad pads computed from Constants (as TorchScript exports them) fold into
    Constant nodes; a Transpose of the weight is a parameter's use and stays."""
    helper, tensor = onnx.helper, onnx.TensorProto
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0], name="wt"),
        helper.make_node("MatMul", ["x", "wt"], ["h"], name="mm"),
        helper.make_node("Constant", [], ["c0"], value=helper.make_tensor("c0", tensor.INT64, [2], [0, 1]), name="c0"),
        helper.make_node("Constant", [], ["c1"], value=helper.make_tensor("c1", tensor.FLOAT, [2], [0, 2]), name="c1"),
        helper.make_node("Cast", ["c1"], ["c1i"], to=tensor.INT64, name="cast"),
        helper.make_node("Concat", ["c0", "c1i"], ["pads"], axis=0, name="concat"),
        helper.make_node("Pad", ["h", "pads"], ["hp"], name="pad"),
        helper.make_node("Constant", [], ["a"], value=helper.make_tensor("a", tensor.INT64, [1], [1]), name="a"),
        helper.make_node("Neg", ["a"], ["na"], name="neg"),
        helper.make_node("Mul", ["hp", "hp"], ["sq"], name="sq"),
        helper.make_node("ReduceSum", ["sq", "na"], ["r"], keepdims=0, name="reduce"),
        helper.make_node("ReduceMean", ["r"], ["loss"], keepdims=0, name="mean"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", tensor.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("loss", tensor.FLOAT, [])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    step = build_training_graph(model, optimizer=None)
    ops = [n.op_type for n in step.graph if n.metadata_props.get(NODE_ROLE) == "forward"]
    assert "Concat" not in ops and "Neg" not in ops and "Cast" not in ops and "Transpose" in ops
    x = rng.standard_normal((2, 4)).astype(np.float32)
    loss, grad = _session(step).run(["loss", "grad/w"], {"x": x})
    wt = torch.tensor(onnx.numpy_helper.to_array(w), requires_grad=True)
    h = torch.nn.functional.pad(torch.tensor(x) @ wt.T, (1, 2))  # ONNX pads [0, 1, 0, 2]: axis 1 by (1, 2)
    expected = (h * h).sum(-1).mean()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, wt.grad.numpy(), rtol=1e-5)


def test_integer_only_graph_is_rejected() -> None:
    helper = onnx.helper
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                              [helper.make_tensor_value_info("a", onnx.TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("c", onnx.TensorProto.INT64, [2])],
                              [onnx.numpy_helper.from_array(np.ones(2, np.int64), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    with pytest.raises(MpgraphError):
        build_training_graph(model, loss="mse")


# ---------------------------------------------------------------------------------------------
# Real models from the onnx wheel: every one passes a finite-difference check
# ---------------------------------------------------------------------------------------------

# VGG-19 is left out: its check took 33-45 s and it has no op type AlexNet lacks (Conv, Relu,
# MaxPool, Flatten/Gemm, Dropout, Softmax).
REAL = [p for p in sorted(glob.glob(str(ONNX_DATA / "light" / "*.onnx"))) if Path(p).stem != "light_vgg19"] + sorted(
    glob.glob(str(ONNX_DATA / "pytorch-converted" / "*" / "model.onnx"))
)


def _real_id(path: str) -> str:
    p = Path(path)
    return p.stem if p.parent.name == "light" else p.parent.name


def _random_feed(session: ort.InferenceSession, rng: np.random.Generator, skip: Collection[str] = ()) -> dict[str, np.ndarray]:
    feeds = {}
    for i in session.get_inputs():
        if i.name in skip:
            continue
        shape = [d if isinstance(d, int) else 2 for d in i.shape]
        if i.type == "tensor(int64)":
            feeds[i.name] = rng.integers(0, 3, size=shape).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


FD_STEPS = (1e-3, 1e-4, 1e-5)
# Relative agreement required at the best of the steps (ORT 1.32 CPU, fp32). 84 of the 90
# models agree to 1.2e-3 or better; the 84 under FD_TOLERANCE agree to 1.6e-4 (light_shufflenet)
# or better, most to 1e-5 (benchmarks/results/fd_real_models.txt). The other six are listed
# with about twice their measured error: fp32
# central differences through max pooling and deep ReLU nets cross kinks at large steps and hit
# rounding at small ones. AlexNet's bound (measured 5.5e-2) cannot see an error under ~10%;
# ORT CPU has no float64 Conv for a better oracle, and the op types are all checked tightly
# elsewhere (tests/test_gradients.py, the smaller nets here).
FD_TOLERANCE = 5e-4
FD_TOLERANCE_MEASURED = {
    "test_MaxPool2d": 4e-3,  # 2.0e-3
    "test_MaxPool1d_stride_padding_dilation": 9e-3,  # 4.3e-3
    "light_squeezenet": 2.5e-3,  # 1.2e-3
    "light_densenet121": 3.5e-3,  # 1.7e-3
    "light_zfnet512": 1.5e-2,  # 7.4e-3
    "light_bvlc_alexnet": 0.1,  # 5.5e-2
}
# These checks take 2.5-11 s of CPU each (ZFNet-512 the most); the other light models 0.5-2 s.
SLOW_REAL = {"light_bvlc_alexnet", "light_densenet121", "light_inception_v2", "light_resnet50", "light_zfnet512"}


_SLICE = 1 << 18


def _directional_check(model_path: str) -> list[float]:
    """Build a gradient graph with an mse loss on the first float output; compare the
    directional derivative along a random direction with central differences (fp32). Returns
    the relative errors at the steps tried (the last within the model's tolerance)."""
    proto = onnx.load(model_path)
    floats = [v for v in proto.graph.initializer if v.data_type == onnx.TensorProto.FLOAT]
    trainable = () if floats or any(n.op_type == "ConstantOfShape" for n in proto.graph.node) else ("*",)
    # The full checker on the materialized light models (up to 550 MB of weights) costs more
    # than the rest of the check; every other model here is validated.
    light = Path(model_path).parent.name == "light"
    step = build_training_graph(proto, optimizer=None, loss="mse", trainable_inputs=trainable, validate=not light)
    grads = [v.name for v in step.graph.outputs if v.name.startswith("grad/")]
    params = [g[len("grad/"):] for g in grads]
    # Every parameter is fed at every run: the session's model leaves out their initializers
    # (the light models' weigh up to 350 MB, serialized and loaded for nothing).
    inits = step.graph.initializers
    stored = {name: inits.pop(name).const_value.numpy() for name in params if name in inits}
    session = _session(step)
    rng = np.random.default_rng(0)
    base = _random_feed(session, rng, skip=stored)
    # A zero target keeps the loss proportional to the output: a random target adds a
    # constant that drowns the fp32 differences of flat (softmax) outputs.
    base["label"] = np.zeros_like(base["label"])
    for name, value in stored.items():
        value = value if value.dtype == np.float32 else value.astype(np.float32)
        if value.ndim >= 2 and value.min() == value.max():
            # "light" files fill weights with one constant: every channel is identical and
            # the softmax output cannot move. Draw He-scaled weights instead (float64 draws,
            # rounded to float32; drawn in slices, the same numbers as one draw).
            scale = np.sqrt(2.0 / int(np.prod(value.shape[1:])))
            value = np.empty(value.shape, np.float32)
            flat, drawn = value.reshape(-1), np.empty(min(value.size, _SLICE))
            for i in range(0, value.size, _SLICE):
                part = drawn[:min(_SLICE, value.size - i)]
                rng.standard_normal(out=part)
                part *= scale
                flat[i:i + part.size] = part
        base[name] = value
    outs = session.run(grads, base)
    # Direction: the normalized gradient plus a normalized random vector. The gradient part
    # keeps the directional derivative well above fp32 noise in deep nets (a random direction
    # alone is nearly orthogonal to the gradient); the random part checks other components.
    # In place and in slices of _SLICE elements: the light models hold up to 87 M parameters,
    # and a float64 temporary per whole-array operation made the numpy work, not ORT, most of
    # their check's time.
    direction = {p: rng.standard_normal(base[p].shape) for p in params}
    g_norm = np.sqrt(sum(float(np.vdot(g, g)) for g in outs)) or 1.0
    n_norm = np.sqrt(sum(float(np.vdot(v, v)) for v in direction.values()))
    for g, p in zip(outs, params, strict=True):
        d, gf = direction[p].reshape(-1), g.reshape(-1)
        for i in range(0, d.size, _SLICE):
            d[i:i + _SLICE] /= n_norm
            d[i:i + _SLICE] += gf[i:i + _SLICE] / g_norm
    analytic = sum(float(np.vdot(gf[i:i + _SLICE].astype(np.float64), d[i:i + _SLICE]))
                   for gf, d in ((g.reshape(-1), direction[p].reshape(-1)) for g, p in zip(outs, params, strict=True))
                   for i in range(0, d.size, _SLICE))
    scale = max(np.sqrt(sum(float(np.vdot(base[p], base[p])) for p in params)), 1.0)
    norm_d = np.sqrt(sum(float(np.vdot(d, d)) for d in direction.values()))
    moved = {p: np.empty_like(base[p]) for p in params}
    feed = {**base, **moved}

    def loss_at(eps: float) -> float:
        for p in params:
            # base + eps * direction in float64, rounded once to float32
            d, b, m = direction[p].reshape(-1), base[p].reshape(-1), moved[p].reshape(-1)
            for i in range(0, d.size, _SLICE):
                np.add(b[i:i + _SLICE], d[i:i + _SLICE] * eps, out=m[i:i + _SLICE])
        return float(session.run(["loss"], feed)[0])

    # Several steps: the larger ones are robust to fp32 rounding, the smaller ones to kinks
    # (ReLU, max pooling) that a large step crosses. One must agree to the tolerance.
    tolerance = FD_TOLERANCE_MEASURED.get(_real_id(model_path), FD_TOLERANCE)
    errors = []
    for step_size in FD_STEPS:
        eps = step_size * scale / norm_d
        numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
        errors.append(abs(numeric - analytic) / max(abs(numeric), abs(analytic), 1e-3))
        if errors[-1] <= tolerance:
            break
    assert min(errors) <= tolerance, (model_path, errors, analytic)
    return errors


def test_real_models_found() -> None:
    assert len(REAL) == 8 + 82  # light (VGG-19 left out) + pytorch-converted


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if _real_id(p) in SLOW_REAL else p for p in REAL],
    ids=[_real_id(p) for p in REAL],
)
def test_real_model_gradient(path: str) -> None:
    """Every model builds a step graph (a GradientError fails) that passes the check."""
    _directional_check(path)


def test_finite_difference_check_catches_a_two_percent_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has the power to see a subtly wrong rule: a Relu gradient scaled by 1.02."""
    import dataclasses

    from mpgraph.autodiff import registry

    (rule,) = registry._RULES[("", "Relu")]

    def wrong(ctx, node, dy):
        (dx,) = rule.fn(ctx, node, dy)
        return (ctx.op("Mul", dx, ctx.scalar(1.02, node.inputs[0])),)

    path = next(p for p in REAL if _real_id(p) == "test_ReLU")
    assert _directional_check(path)[-1] <= FD_TOLERANCE
    monkeypatch.setitem(registry._RULES, ("", "Relu"), [dataclasses.replace(rule, fn=wrong)])
    with pytest.raises(AssertionError):
        _directional_check(path)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_train_graph(tmp_path: Path) -> None:
    """The real app (mpgraph.cli.main), in-process: a step graph written, and a one-line refusal."""
    from tests.helpers import mpgraph_cli

    _zoo("tiny_mlp")
    out = tmp_path / "tiny.train.onnx"
    ok = mpgraph_cli("train-graph", str(ZOO_DIR / "tiny_mlp.loss.onnx"), "-o", str(out),
                     "--optimizer", "sgd", "--momentum", "0.9", "--freeze", "fc1.*")
    assert ok.returncode == 0, ok.stderr
    saved = onnx.load(str(out))
    onnx.checker.check_model(saved, full_check=True)
    assert {p.key: p.value for p in saved.metadata_props}[MODEL_TRAINING] == "true"
    state = {a for a, _ in json.loads({p.key: p.value for p in saved.metadata_props}[MODEL_STATE_PAIRS])}
    assert "fc2.weight" in state and "fc1.weight" not in state  # frozen
    bad = mpgraph_cli("train-graph", str(ZOO_DIR / "tiny_mlp.onnx"), "-o", str(tmp_path / "x.onnx"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "no loss" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and not (tmp_path / "x.onnx").exists()


def test_conv_weight_gradient_layout_follows_map_size() -> None:
    """Large feature maps get per-sample products summed over the batch; small ones one GEMM."""
    _zoo("resnet")
    step = build_training_graph(ZOO_DIR / "resnet.loss.onnx", optimizer=None)
    convs = {n.inputs[1].name: n.name for n in step.graph if n.op_type == "Conv" and not n.name.startswith("grad/")}
    ops = {weight: {n.op_type for n in step.graph if n.name.startswith(f"grad/{name}/")} for weight, name in convs.items()}
    # 32x32 map, 16 out: per-sample products summed over the batch (a ones-vector MatMul)
    assert "ConstantOfShape" in ops["layer1.conv1.weight"] and "Gemm" not in ops["layer1.conv1.weight"]
    # 8x8 map, 64 out: one GEMM
    assert "Gemm" in ops["layer3.conv2.weight"] and "ConstantOfShape" not in ops["layer3.conv2.weight"]


def test_strided_first_conv_weight_gradient_uses_space_to_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The im2col form packs the 8x8/4 conv with SpaceToDepth; by default (the form picked by
    shape) that layer's weight gradient is one Conv of the axis-swapped input and dy."""
    from mpgraph.autodiff.rules import pool_conv

    _zoo("dqn_cnn")
    default = build_training_graph(ZOO_DIR / "dqn_cnn.loss.onnx", optimizer=None)
    assert not [n for n in default.graph if n.op_type == "SpaceToDepth"]
    monkeypatch.setattr(pool_conv, "WEIGHT_GRAD_FORM", "im2col")
    step = build_training_graph(ZOO_DIR / "dqn_cnn.loss.onnx", optimizer=None)
    packed = [n for n in step.graph if n.op_type == "SpaceToDepth"]
    assert len(packed) == 1 and packed[0].inputs[0].name == "x"  # only the 8x8/4 conv (the 4x4/2 one has a small map)
