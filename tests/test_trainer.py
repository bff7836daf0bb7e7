"""The trainer, datasets and ``mpgraph train`` on ORT CPU (CUDA tests are marked ``gpu``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mpgraph._ir import meta as md
from mpgraph.cli.plots import plot_losses
from mpgraph.data import Batches, InputSpec, dataset_for_model, fit_to_inputs, load_dataset
from mpgraph.errors import MpgraphError
from mpgraph.io import save_model
from mpgraph.runtime.checkpoint import graph_fingerprint
from mpgraph.runtime.metrics import Metrics
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner
from tests.helpers import Ran, mpgraph_cli

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.fixture(scope="module")
def digits_loss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64-32-10 MLP with a cross-entropy loss, exported from torch."""
    torch = pytest.importorskip("torch")
    from mpgraph.export import export_module

    class DigitsMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(64, 32)
            self.fc2 = torch.nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("digits") / "digits_mlp.loss.onnx"
    export_module(DigitsMLP(), torch.randn(4, 64), path, loss="cross_entropy")
    return path


@pytest.fixture(scope="module")
def step_path(digits_loss: Path) -> Path:
    path = digits_loss.with_name("digits_mlp.adamw.onnx")
    save_model(build_training_graph(digits_loss, optimizer="adamw"), path)
    return path


@pytest.fixture(scope="module")
def sgd_step_path(digits_loss: Path) -> Path:
    path = digits_loss.with_name("digits_mlp.sgd.onnx")
    save_model(build_training_graph(digits_loss, optimizer="sgd"), path)
    return path


@pytest.fixture(scope="module")
def digits(step_path: Path):
    return dataset_for_model("digits", Trainer(step_path).data_inputs)


def _batches(dataset, n: int, batch: int = 32, seed: int = 0) -> list[dict[str, np.ndarray]]:
    it = Batches(dataset.train, batch, seed)
    return [next(it) for _ in range(n)]


# -- training ----------------------------------------------------------------------------


def test_digits_mlp_trains_and_evaluates(step_path: Path, digits):
    trainer = Trainer(step_path, threads=1)
    metrics = trainer.fit(digits, steps=150, lr=1e-2, batch_size=64)
    assert len(metrics) == 150 and trainer.steps == 150
    assert np.mean(metrics.loss[-20:]) < 0.25 * np.mean(metrics.loss[:20])
    assert not any(metrics.skipped) and all(s is None for s in metrics.loss_scale)
    assert trainer.evaluate(digits.test)["accuracy"] > 0.9


def test_iobinding_keeps_state_like_cpu_runner(step_path: Path, digits):
    batches = _batches(digits, 8)
    trainer, runner = Trainer(step_path), CpuRunner(step_path)
    assert [trainer.step(b, 1e-2).loss for b in batches] == [runner.step(b, lr=1e-2) for b in batches]
    ours, theirs = trainer.state, runner.state
    assert all(ours[k].tobytes() == theirs[k].tobytes() for k in theirs)  # CpuRunner keeps scalars as [1]
    assert ours["optim/step"] == 8  # state carried across steps, not reset


def test_user_state_is_not_modified(step_path: Path, digits):
    init = {"fc1.weight": np.zeros((32, 64), np.float32)}
    Trainer(step_path, state=init).fit(digits, 3, 1e-2)
    assert not init["fc1.weight"].any()


def test_sequence_task_trains_a_gpt():
    step = build_training_graph("models/onnx/gpt.loss.onnx", optimizer="adamw")
    trainer = Trainer(step)
    tokens = next(s for s in trainer.data_inputs if s.dtype.kind == "i" and s.name != "label")
    ds = dataset_for_model("sequence", trainer.data_inputs, size=256)
    assert ds.train[tokens.name].shape == (256, 16) and ds.train["label"].max() < 64
    metrics = trainer.fit(ds, 30, 3e-3, batch_size=16)
    assert np.mean(metrics.loss[-5:]) < np.mean(metrics.loss[:5])
    assert trainer.evaluate(ds.test)["accuracy"] > 2 / 64  # chance is 1/64; measured 0.054


# -- checkpoints -------------------------------------------------------------------------


def test_resume_is_bit_identical(step_path: Path, digits, tmp_path: Path):
    full = Trainer(step_path, threads=1)
    full.fit(digits, 24, 1e-2, batch_size=32, seed=3)

    first = Trainer(step_path, threads=1)
    first.fit(digits, 11, 1e-2, batch_size=32, seed=3)
    ckpt = tmp_path / "run.ckpt.npz"
    first.save_checkpoint(ckpt)
    assert not list(tmp_path.glob(".*.tmp"))

    resumed = Trainer(step_path, threads=1)
    resumed.load_checkpoint(ckpt)
    assert resumed.steps == 11
    resumed.fit(digits, 13, 1e-2, batch_size=32, seed=3)
    assert resumed.metrics.loss == full.metrics.loss  # exact floats, history included
    assert resumed.metrics.step == list(range(1, 25))
    a, b = full.state, resumed.state
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_checkpoint_from_another_graph_is_refused(step_path: Path, sgd_step_path: Path, tmp_path: Path):
    ckpt = tmp_path / "adamw.npz"
    Trainer(step_path).save_checkpoint(ckpt)
    assert graph_fingerprint(ir.load(str(step_path))) != graph_fingerprint(ir.load(str(sgd_step_path)))
    with pytest.raises(MpgraphError, match="different graph"):
        Trainer(sgd_step_path).load_checkpoint(ckpt)
    with pytest.raises(MpgraphError, match="no such checkpoint"):
        Trainer(step_path).load_checkpoint(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(MpgraphError, match="not an mpgraph checkpoint"):
        Trainer(step_path).load_checkpoint(tmp_path / "junk.npz")


# -- loss scaling state, providers, dtypes -----------------------------------------------


@pytest.fixture(scope="module")
def hot_step_path(digits_loss: Path) -> Path:
    """fp16 (emulated) with the convert pass's dynamic loss scaling from 2**24, a scale at which
    the first gradients overflow fp16."""
    import mpgraph
    from mpgraph.policy import parse_policy

    policy = parse_policy("extends: fp16\nname: fp16-hot\nloss_scaling: {mode: dynamic, init: 16777216}\n", "hot.yaml")
    path = digits_loss.with_name("digits_mlp.fp16-hot.onnx")
    save_model(mpgraph.convert(build_training_graph(digits_loss, optimizer="adamw"), policy, emulate=True), path)
    return path


def test_loss_scale_and_found_inf_are_reported(hot_step_path: Path, digits, tmp_path: Path):
    """Each step reports the scale it ran with and whether it was skipped; a skip halves the
    scale, a finite step keeps it (growth interval 2000) and counts in the growth tracker.
    Measured: the first five steps overflow (2**24 .. 2**20), then 2**19 goes through."""
    trainer = Trainer(hot_step_path, threads=1)
    assert trainer.has_loss_scale and trainer.found_inf_name == md.FOUND_INF
    results = [trainer.step(b, 1e-2) for b in _batches(digits, 8)]
    scales = [r.loss_scale for r in results] + [trainer.loss_scale]
    skipped = [r.skipped for r in results]
    assert scales[0] == 2.0**24 and skipped[0] and not all(skipped)
    for i, skip in enumerate(skipped):
        assert scales[i + 1] == (scales[i] / 2 if skip else scales[i]), i
    since_skip = len(skipped) - 1 - max(i for i, skip in enumerate(skipped) if skip)
    assert trainer.state[md.GROWTH_TRACKER] == since_skip > 0
    ckpt = tmp_path / "scaled.npz"
    trainer.save_checkpoint(ckpt)
    again = Trainer(hot_step_path, threads=1)
    again.load_checkpoint(ckpt)
    assert again.loss_scale == trainer.loss_scale and again.metrics.skipped == skipped


def test_native_low_precision_on_cpu_is_refused(step_path: Path):
    model = ir.load(str(step_path))
    model.metadata_props[md.MODEL_DTYPE] = "bfloat16"
    with pytest.raises(MpgraphError, match="--emulate"):
        Trainer(model)
    model.metadata_props[md.MODEL_EMULATED] = "true"
    Trainer(model)  # the emulated lowering runs on CPU


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
def test_unavailable_provider_is_one_line(step_path: Path):
    with pytest.raises(MpgraphError, match="not available") as err:
        Trainer(step_path, provider="cuda")
    assert "\n" not in str(err.value)
    with pytest.raises(MpgraphError, match="unknown provider"):
        Trainer(step_path, provider="tpu")


def test_not_a_step_graph_is_refused(digits_loss: Path):
    with pytest.raises(MpgraphError, match="not a training step graph"):
        Trainer(digits_loss)


def test_node_providers_on_cpu(step_path: Path):
    """ORT >= 1.23 reports placement (all CPU here); an older ORT reports nothing, as documented."""
    placement = Trainer(step_path).node_providers()
    if hasattr(ort.InferenceSession, "get_provider_graph_assignment_info"):
        assert placement and set(placement.values()) == {"CPUExecutionProvider"}
    else:
        assert placement == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDAExecutionProvider")
def test_cuda_matches_cpu_and_stays_on_gpu(step_path: Path, digits):
    batches = _batches(digits, 5)
    cpu, gpu = Trainer(step_path), Trainer(step_path, provider="cuda")
    lc = [cpu.step(b, 1e-2).loss for b in batches]
    lg = [gpu.step(b, 1e-2).loss for b in batches]
    np.testing.assert_allclose(lg, lc, rtol=1e-3, atol=1e-4)
    assert gpu.executor.state_set()["fc1.weight"].device_name().lower() == "cuda"
    placement = gpu.node_providers()
    assert placement and "CUDAExecutionProvider" in placement.values()


# -- data --------------------------------------------------------------------------------


def test_unknown_and_missing_datasets(tmp_path: Path):
    with pytest.raises(MpgraphError, match=r"unknown dataset 'foo'; valid: digits, sequence, or a path to \.npz"):
        load_dataset("foo")
    with pytest.raises(MpgraphError, match="no such dataset file"):
        load_dataset(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    with pytest.raises(MpgraphError, match="not a readable .npz"):
        load_dataset(tmp_path / "bad.npz")


def test_npz_dataset_keys_are_input_names(step_path: Path, tmp_path: Path):
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.standard_normal((40, 64)), label=rng.integers(0, 10, 40),
             test_x=rng.standard_normal((8, 64)), test_label=rng.integers(0, 10, 8))
    trainer = Trainer(step_path)
    ds = dataset_for_model(path, trainer.data_inputs)
    assert ds.train["x"].dtype == np.float32 and ds.test["label"].shape == (8,)
    trainer.fit(ds, 3, 1e-3, batch_size=16)
    np.savez(tmp_path / "wrong.npz", x=np.zeros((4, 64), np.float32))
    with pytest.raises(MpgraphError, match="no array for graph input.*'label'"):
        dataset_for_model(tmp_path / "wrong.npz", trainer.data_inputs)


def test_digits_split_and_cnn_layout():
    ds = load_dataset("digits")
    assert ds.train["x"].shape == (1438, 64) and ds.test["x"].shape == (359, 64)
    assert abs(float(ds.train["x"].mean())) < 1e-4
    again = load_dataset("digits")
    assert np.array_equal(ds.test["label"], again.test["label"])
    cnn = fit_to_inputs(ds, [InputSpec("image", np.dtype(np.float32), ("batch", 1, 8, 8)),
                             InputSpec("label", np.dtype(np.int64), ("batch",))])
    assert cnn.train["image"].shape == (1438, 1, 8, 8)


def test_sequence_labels_are_next_tokens():
    ds = load_dataset("sequence", seq_len=12, vocab=32, size=64, seed=1)
    tok, lab = ds.train["tokens"], ds.train["label"]
    assert tok.shape == lab.shape == (64, 12) and tok.dtype == np.int64
    assert np.array_equal(tok[:, 1:], lab[:, :-1])
    assert np.array_equal(tok, load_dataset("sequence", seq_len=12, vocab=32, size=64, seed=1).train["tokens"])


def test_batches_are_seeded_and_resumable():
    arrays = {"a": np.arange(10)}
    first = Batches(arrays, 4, seed=5)
    seen = [next(first)["a"] for _ in range(5)]
    resumed = Batches(arrays, 4, seed=5, position=Batches(arrays, 4, seed=5).position)
    assert all(np.array_equal(s, next(resumed)["a"]) for s in seen)
    mid = Batches(arrays, 4, seed=5)
    for _ in range(3):
        next(mid)
    cont = Batches(arrays, 4, seed=5, position=mid.position)
    assert np.array_equal(next(cont)["a"], seen[3])
    assert sorted(np.concatenate(seen[:2]).tolist()) != list(range(8))  # shuffled


# -- metrics and plots -------------------------------------------------------------------


def test_metrics_csv_json_and_plot(step_path: Path, digits, tmp_path: Path):
    trainer = Trainer(step_path)
    metrics = trainer.fit(digits, 12, 1e-2)
    metrics.to_csv(tmp_path / "m.csv")
    metrics.to_json(tmp_path / "m.json")
    lines = (tmp_path / "m.csv").read_text().splitlines()
    assert lines[0] == "step,loss,loss_scale,skipped,seconds" and len(lines) == 13
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["summary"]["steps"] == 12 and doc["metrics"]["loss"] == metrics.loss
    other = Metrics.from_dict(doc["metrics"])
    other.loss = [x * 2 for x in other.loss]
    other.loss[3] = float("nan")
    other.skipped[3] = True
    plot_losses({"adamw": metrics, "doubled": other}, tmp_path / "loss.png", title="two runs")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(other.to_dict()))["loss"][3] is None


# -- the CLI -----------------------------------------------------------------------------


def _mpgraph(*args: str, cwd: Path) -> Ran:
    """``mpgraph ARGS`` in-process (the real app) from the folder ``cwd``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        return mpgraph_cli(*args)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_train_resume_and_refusals(step_path: Path, sgd_step_path: Path, tmp_path: Path):
    ckpt, metrics, plot = tmp_path / "c.npz", tmp_path / "m.json", tmp_path / "p.png"
    run = _mpgraph("train", str(step_path), "--data", "digits", "--steps", "40", "--lr", "1e-2",
                   "--batch", "32", "--checkpoint", str(ckpt), "--metrics", str(metrics), "--plot", str(plot),
                   "--seed", "0", "--quiet", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "40 steps" in run.stdout and "test accuracy" in run.stdout
    assert json.loads(metrics.read_text())["summary"]["steps"] == 40 and plot.stat().st_size > 0

    more = _mpgraph("train", str(step_path), "--resume", str(ckpt), "--checkpoint", str(ckpt),
                    "--steps", "5", "--lr", "1e-2", "--batch", "32", "--metrics", str(tmp_path / "m.csv"),
                    "--quiet", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 1 + 45

    before = _digest(ckpt)
    bad = _mpgraph("train", str(sgd_step_path), "--resume", str(ckpt), "--checkpoint", str(ckpt),
                   "--steps", "5", cwd=tmp_path)
    assert bad.returncode == 2 and "different graph" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert _digest(ckpt) == before

    for args, message in (
        (["--data", "foo"], "unknown dataset 'foo'"),
        (["--provider", "tpu"], "unknown provider"),
        (["--plot", str(tmp_path / "nowhere" / "p.png")], "does not exist"),
    ):
        res = _mpgraph("train", str(step_path), "--steps", "1", "--checkpoint", str(ckpt), *args, cwd=tmp_path)
        assert res.returncode == 2 and message in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
        assert _digest(ckpt) == before


def test_convert_loss_scaling_skips_overflowing_steps(hot_step_path: Path):
    """With the convert pass's dynamic loss scaling and an init scale that overflows fp16, the
    first steps are skipped and the scale backs off until steps go through."""
    step = ir.load(str(hot_step_path))
    pairs = json.loads(step.metadata_props[md.MODEL_STATE_PAIRS])
    assert md.LOSS_SCALE in {a for a, _ in pairs}  # a convert without the state must fail here
    trainer = Trainer(step, threads=1)
    metrics = trainer.fit(dataset_for_model("digits", trainer.data_inputs), 30, 1e-2)
    assert metrics.skipped[0] and not all(metrics.skipped)
    assert metrics.loss_scale[0] == 16777216.0 and trainer.loss_scale < 16777216.0
    assert np.mean(metrics.loss[-5:]) < np.mean(metrics.loss[:5])


def test_replay_buffers_match_the_plain_path_on_cpu():
    """The CUDA-graph path (a shape-specialised session, fixed batch/lr/loss buffers, one
    binding per parity, in-place lr and checkpoint updates) must train exactly like the plain
    path. CPU cannot capture graphs, but it runs the same buffer logic when forced."""
    from mpgraph.lowering.specialize import shape_ops, specialize_shapes

    step = build_training_graph(str(Path(__file__).resolve().parents[1] / "models" / "onnx" / "gpt.loss.onnx"), optimizer="adamw")
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 64, (4, 16)), "label": rng.integers(0, 64, (4, 16))} for _ in range(3)]
    plain, forced = Trainer(step, "cpu"), Trainer(step, "cpu")
    for i in range(7):
        if i == 1:
            # What provider="cuda" sets; the CPU session just never captures. Starting at an
            # odd step checks that the replay bindings follow the buffer parity.
            forced.executor._want_graph = True
        lr = 1e-3 if i < 4 else 5e-4  # an lr change must reach the fixed lr buffer
        a, b = plain.step(batches[i % 3], lr), forced.step(batches[i % 3], lr)
        assert a.loss == b.loss, i
    assert forced.executor.replay is not None and forced.cuda_graph
    odd = {"tokens": batches[0]["tokens"][:2], "label": batches[0]["label"][:2]}
    assert plain.step(odd).loss == forced.step(odd).loss  # another shape: the plain session
    saved = plain.state
    forced.executor.set_state(saved)  # a checkpoint load: same buffers, overwritten in place
    assert forced.executor.replay is not None
    for name, value in forced.state.items():
        np.testing.assert_array_equal(value, saved[name])
    assert plain.step(batches[0]).loss == forced.step(batches[0]).loss
    fixed = specialize_shapes(step, {"tokens": (4, 16), "label": (4, 16)})
    assert shape_ops(step) > 0 and shape_ops(fixed) == 0


# -- runtime papercuts (issue 12) ----------------------------------------------------------------


def test_sequence_dataset_fits_hugging_face_names():
    inputs = [InputSpec("input_ids", np.dtype(np.int64), ("batch", 12)),
              InputSpec("attention_mask", np.dtype(np.int64), ("batch", 12)),
              InputSpec("labels", np.dtype(np.int64), ("batch", 12))]
    ds = dataset_for_model("sequence", inputs, size=64, vocab=16)
    assert sorted(ds.train) == ["attention_mask", "input_ids", "labels"]
    assert ds.train["input_ids"].shape == (64, 12) and ds.train["input_ids"].max() < 16
    # Hugging Face causal LMs shift labels inside the model: labels are the input ids.
    np.testing.assert_array_equal(ds.train["labels"], ds.train["input_ids"])
    assert (ds.train["attention_mask"] == 1).all() and (ds.test["attention_mask"] == 1).all()
    assert ds.task == "custom"
    # mpgraph's own names keep next-token labels.
    own = dataset_for_model("sequence", [InputSpec("input_ids", np.dtype(np.int64), ("batch", 12)),
                                         InputSpec("label", np.dtype(np.int64), ("batch", 12))], size=64, vocab=16)
    assert sorted(own.train) == ["input_ids", "label"] and own.task == "sequence"
    np.testing.assert_array_equal(own.train["label"][:, :-1], own.train["input_ids"][:, 1:])


def test_trainer_sessions_print_no_initializer_warnings(capfd: pytest.CaptureFixture[str]):
    step = build_training_graph("models/onnx/resnet.loss.onnx")
    proto = ir.to_proto(step)
    # Plain ORT prints one warning per parameter that is both an initializer and an input...
    options = ort.SessionOptions()
    options.log_severity_level = 2
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert capfd.readouterr().err.count("appears in graph inputs") >= 20
    # ... the trainer's sessions (step and evaluation) print none.
    trainer = Trainer(proto)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 3, 32, 32)).astype(np.float32), "label": rng.integers(0, 10, 4)}
    trainer.step(batch)
    trainer.evaluate(batch)
    assert "appears in graph inputs" not in capfd.readouterr().err


def test_cpu_runner_leaves_the_models_initial_weights_alone():
    """Stepping must not write trained weights into the model's initializers (it shared
    their memory once, so a later convert() of the same model started from trained weights)."""
    from tests.cpu_runner import CpuRunner

    step = build_training_graph(str(Path(__file__).resolve().parents[1] / "models" / "onnx" / "tiny_mlp.loss.onnx"),
                                optimizer="adamw", lr=0.05)
    before = {n: v.const_value.numpy().copy() for n, v in step.graph.initializers.items() if v.const_value is not None}
    runner = CpuRunner(step)
    rng = np.random.default_rng(0)
    for _ in range(3):
        runner.step({"x": rng.standard_normal((8, 4)).astype(np.float32), "label": rng.integers(0, 2, (8,))})
    changed = [n for n, v in step.graph.initializers.items()
               if v.const_value is not None and not np.array_equal(v.const_value.numpy(), before[n])]
    assert not changed, changed
    assert any(not np.array_equal(runner.state[n], before[n]) for n in runner.state if n in before)


def test_deterministic_sets_ort_deterministic_compute(step_path: Path):
    assert Trainer(step_path, deterministic=True).session.get_session_options().use_deterministic_compute
    assert not Trainer(step_path).session.get_session_options().use_deterministic_compute
