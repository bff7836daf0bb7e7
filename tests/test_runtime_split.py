"""The runtime's parts on their own: session options, the forward cut, checkpoints, a run.

``test_trainer.py`` covers the ``Trainer`` as a whole; these pin what each module of
``mpgraph/runtime/`` promises by itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.errors import CheckpointError, MpgraphError, TrainingError
from mpgraph.runtime import providers
from mpgraph.runtime.checkpoint import MetricsLog, metrics_path, read_checkpoint, write_checkpoint
from mpgraph.runtime.metrics import Metrics, StepResult
from mpgraph.runtime.trainer import Trainer, run_training
from mpgraph.training import build_training_graph

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"


@pytest.fixture(scope="module")
def mlp_step() -> ir.Model:
    return build_training_graph(str(ZOO / "tiny_mlp.loss.onnx"), optimizer="adamw", lr=0.05)


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))  # convert() rewrites its argument


def _batch(seed: int = 0, n: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 4)).astype(np.float32), "label": rng.integers(0, 2, (n,))}


# -- providers.py ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("props", "tf32", "want"), [
    ({}, None, "0"),  # absent: strict float32, not ORT CUDA's silent TF32
    ({md.MODEL_TF32: "true"}, None, "1"),  # the tf32 preset
    ({md.MODEL_TF32: "true"}, False, "0"),  # an explicit choice wins
    ({}, True, "1"),
])
def test_cuda_options_take_tf32_from_the_graph_unless_told(props: dict[str, str], tf32: bool | None, want: str):
    use, options = providers.provider_options(props, "cuda", device_id=0, tf32=tf32, extra=None)
    assert options["use_tf32"] == want and use == (want == "1")


def test_caller_provider_options_win_and_cpu_gets_none_derived():
    _, options = providers.provider_options({}, "cuda", device_id=0, tf32=None, extra={"use_tf32": 1})
    assert options["use_tf32"] == "1"
    assert providers.provider_options({md.MODEL_TF32: "true"}, "cpu", device_id=0, tf32=None, extra=None)[1] == {}


def test_unknown_provider_and_native_bf16_on_cpu_are_refused(mlp_step: ir.Model):
    with pytest.raises(MpgraphError, match="unknown provider 'tpu'; valid: cpu, cuda"):
        providers.check_provider(mlp_step, "tpu")
    with pytest.raises(MpgraphError, match="native bfloat16 lowering"):
        providers.check_provider(mpgraph.convert(_copy(mlp_step), "bf16"), "cpu")


def test_logits_come_from_the_metadata_and_old_graphs_fall_back_to_the_guess(mlp_step: ir.Model):
    model = _copy(mlp_step)
    model.metadata_props[md.MODEL_LOGITS] = "recorded"
    assert providers.logits_name(model) == "recorded"
    del model.metadata_props[md.MODEL_LOGITS]  # a step graph saved before the key existed
    assert providers.logits_name(model) == "logits"


def test_forward_cut_of_a_native_bf16_graph_ends_in_a_float32_cast(mlp_step: ir.Model):
    low = mpgraph.convert(_copy(mlp_step), "bf16")
    state = {a for a, _ in json.loads(low.metadata_props[md.MODEL_STATE_PAIRS])}
    proto = ir.to_proto(low)
    kept = [t for t in proto.graph.initializer if t.name not in state]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    from mpgraph.lowering import PlanOptions, plan_session

    plan = plan_session(proto.SerializeToString(), "cpu", PlanOptions(forward_of=providers.logits_name(low)))
    assert plan.custom_ops is None and plan.applied == ()
    forward = ir.from_proto(onnx.load_from_string(plan.graph))
    (output,) = forward.graph.outputs
    assert output.name == "logits/float32" and output.dtype == ir.DataType.FLOAT
    assert output.producer().op_type == "Cast"
    assert not any(n.metadata_props.get(md.NODE_ROLE) in ("backward", "optimizer", "loss") for n in forward.graph)
    assert not forward.graph.initializers.keys() & state  # bound to the trainer's buffers
    onnx.checker.check_model(ir.to_proto(forward), full_check=True)


def test_ort_errors_become_one_line_naming_the_node():
    e = RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while running "
                     "MatMul node. Name:'mm' Status Message: shapes differ\nmore detail")
    assert str(providers.ort_error(e, "running step 3")) == "onnxruntime failed running step 3 at node 'mm' (MatMul): shapes differ"
    assert providers.ort_error(KeyError("x"), "running step 3") is None


# -- checkpoint.py --------------------------------------------------------------------------------


def test_checkpoint_round_trip_and_refusals(tmp_path: Path):
    path = tmp_path / "c.npz"
    metrics = Metrics()
    for step in (1, 2):
        metrics.append(step, StepResult(1.0 / step, None, False, 0.01))
    meta = {"fingerprint": "f" * 32, "steps": 2, "names": ["w", "m"], "data": {"epoch": 0, "index": 16}, "lr": 0.1}
    arrays = [np.ones((2, 3), np.float32), np.zeros((3,), np.float32)]
    write_checkpoint(path, meta, arrays, metrics, MetricsLog(), None)
    want = {"w": ([2, 3], np.float32), "m": ([3], np.float32)}
    got, state, history = read_checkpoint(path, "f" * 32, want)
    assert got["steps"] == 2 and got["data"] == {"epoch": 0, "index": 16} and got["lr"] == 0.1
    np.testing.assert_array_equal(state["w"], arrays[0])
    assert history.loss == metrics.loss and metrics_path(path).exists()
    with pytest.raises(CheckpointError, match="from a different graph"):
        read_checkpoint(path, "0" * 32, want)
    with pytest.raises(CheckpointError, match=r"state 'm' has shape \[3\], the graph wants \[4\]"):
        read_checkpoint(path, "f" * 32, {**want, "m": ([4], np.float32)})
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        read_checkpoint(tmp_path / "none.npz", "f" * 32, want)


def test_metrics_log_appends_only_new_records(tmp_path: Path):
    log, metrics = MetricsLog(), Metrics()
    for step in range(1, 6):
        metrics.append(step, StepResult(float(step), None, False, 0.0))
        if step in (2, 5):
            log.write(tmp_path / "c.npz", metrics)
    lines = metrics_path(tmp_path / "c.npz").read_text().splitlines()
    assert [int(line.split('"step": ')[1].split(",")[0]) for line in lines] == [1, 2, 3, 4, 5]


# -- trainer.run_training -------------------------------------------------------------------------


def test_run_training_checkpoints_every_n_steps_and_at_the_end(mlp_step: ir.Model, tmp_path: Path):
    trainer = Trainer(mlp_step, threads=1)
    seen: list[int] = []
    saves: list[int] = []
    original = trainer.save_checkpoint

    def save(path: object) -> None:
        saves.append(trainer.steps)
        original(path)  # type: ignore[arg-type]

    trainer.save_checkpoint = save  # type: ignore[method-assign]
    stop, seconds = run_training(trainer, _batch(n=32), 5, batch_size=8, checkpoint=tmp_path / "c.npz",
                                 checkpoint_every=2, callback=lambda n, r: seen.append(n))
    assert not stop() and seconds > 0
    assert seen == [1, 2, 3, 4, 5] and saves == [2, 4, 5]


def test_run_training_stops_on_a_nonfinite_batch_and_says_what_it_wrote(mlp_step: ir.Model, tmp_path: Path):
    trainer = Trainer(mlp_step, threads=1)
    bad = _batch()
    bad["x"][0, 0] = np.nan
    with pytest.raises(TrainingError, match=r"step 3.*; wrote checkpoint .*c\.npz \(step 2\)"):
        run_training(trainer, [_batch(1), _batch(2), bad], 3, checkpoint=tmp_path / "c.npz")
    assert Trainer(mlp_step).load_checkpoint(tmp_path / "c.npz") is None


def test_loss_scale_state_is_read_from_its_record_and_old_graphs_fall_back_to_names(mlp_step: ir.Model):
    scaled = mpgraph.convert(_copy(mlp_step), "fp16", emulate=True)
    record = json.loads(scaled.metadata_props[md.MODEL_LOSS_SCALE_STATE])
    trainer = Trainer(scaled, threads=1)
    assert (trainer.found_inf_name, trainer.has_loss_scale) == (record["found_inf"], True)
    assert trainer.loss_scale == float(scaled.graph.initializers[record["scale"]].const_value.numpy())
    del scaled.metadata_props[md.MODEL_LOSS_SCALE_STATE]  # saved before the record existed
    old = Trainer(scaled, threads=1)
    assert (old.found_inf_name, old.loss_scale) == (md.FOUND_INF, trainer.loss_scale)
    assert Trainer(mlp_step).found_inf_name is None and Trainer(mlp_step).loss_scale is None


# -- program.py, executor.py, options.py ----------------------------------------------------------


def test_run_options_are_the_trainer_keywords_and_one_way_in(mlp_step: ir.Model):
    """``Trainer(**keywords)`` and ``Trainer(options=RunOptions(...))`` are the same run; giving
    both is refused rather than silently preferring one."""
    from mpgraph.runtime.options import RunOptions

    options = RunOptions(provider="cpu", threads=1, kernels=False)
    a, b = Trainer(mlp_step, "cpu", threads=1, kernels=False), Trainer(mlp_step, options=options)
    assert a.options == b.options == options and a.kernels_reason == b.kernels_reason == "kernels=False"
    assert a.step(_batch()).loss == b.step(_batch()).loss
    with pytest.raises(MpgraphError, match="either as keywords or as options"):
        Trainer(mlp_step, "cpu", threads=2, options=options)
    assert set(RunOptions.fields()) >= {"provider", "kernels", "pipeline", "deterministic", "cuda_graph"}


def test_the_session_runs_the_plan_the_lowering_made(mlp_step: ir.Model):
    """The runtime rewrites nothing: the session's graph is ``plan_session``'s, byte for byte,
    and the step graph the trainer was given is unchanged."""
    from mpgraph.lowering import PlanOptions, plan_session
    from mpgraph.runtime.program import Program

    before = ir.to_proto(mlp_step).SerializeToString()
    trainer = Trainer(mlp_step, "cpu", threads=1, kernels=True)
    plan = plan_session(Program(mlp_step).session_graph, "cpu", PlanOptions(kernels=True))
    assert trainer.executor.plan.graph == plan.graph and trainer.kernels_fused == plan.kernels_fused > 0
    assert ir.to_proto(mlp_step).SerializeToString() == before
