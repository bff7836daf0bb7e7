"""``Trainer.step_many`` and ``fit`` on a pipelined trainer: the same results as ``step`` one
batch at a time. On CUDA (``pipeline``, on by default there) the steps are enqueued ahead of the
host's loss reads (issue 11: never a sync per step), and ``fit`` still undoes a step whose loss
is not finite, with the step launched after it. On CPU, ``_HostEvents`` stands in for the CUDA
events, so the lagged bookkeeping (results read a step late, two steps undone, a step run
again, checkpoints and exceptions with a step in flight) runs against the plain trainer; the
GPU tests check the pipelined path's bits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from mpgraph.convert import convert
from mpgraph.errors import TrainingError, UsageError
from mpgraph.policy import load_policy
from mpgraph.runtime.executor import Executor
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.helpers import random_batches

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "models/onnx/tiny_mlp.loss.onnx"
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def _same_run(a: Trainer, b: Trainer, results_a: list, results_b: list) -> None:
    assert [r.loss for r in results_a] == [r.loss for r in results_b]
    assert [r.skipped for r in results_a] == [r.skipped for r in results_b]
    assert [r.loss_scale for r in results_a] == [r.loss_scale for r in results_b]
    assert a.steps == b.steps and a.metrics.step == b.metrics.step and a.metrics.loss == b.metrics.loss
    sa, sb = a.state, b.state
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


class _HostEvents:
    """``StepEvents`` on CPU: ORT's CPU runs are done when they return, so nothing is waited
    for, but results are still read a step late and the state has three sets."""

    def provider_options(self) -> dict[str, str]:
        return {}

    def record(self) -> None:  # only captured CUDA graphs record events
        raise AssertionError("no CUDA events on CPU")


@pytest.fixture
def lagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers built in the test are pipelined (CPU), unless given ``pipeline=False``."""

    def events(provider: str, device_id: int, pipeline: bool | None, cuda_graph: bool | None) -> tuple:
        return (None, "pipeline=False") if pipeline is False else (_HostEvents(), "")

    monkeypatch.setattr(Executor, "_pipeline_events", staticmethod(events))


@pytest.fixture(scope="module")
def mlp_step():
    return build_training_graph(MLP, optimizer="adamw")


def _bad_data(n: int = 64) -> dict[str, np.ndarray]:
    """A sample that overflows the first Gemm to inf (a finite batch, a non-finite loss) and one
    with a NaN (refused before its step): each lands in one batch of 16 per epoch."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    x[5] = 3e38
    x[40, 1] = np.nan
    return {"x": x, "label": (rng.standard_normal(n) > 0).astype(np.int64)}


def _same_fit(a: Trainer, b: Trainer) -> None:
    assert a.steps == b.steps and a.metrics.step == b.metrics.step
    assert np.array_equal(a.metrics.loss, b.metrics.loss, equal_nan=True)
    assert a.metrics.skipped == b.metrics.skipped
    sa, sb = a.state, b.state
    assert all(sa[k].tobytes() == sb[k].tobytes() for k in sa)  # bits, NaNs included
    assert a._batches.position == b._batches.position


def test_step_many_is_step_per_batch_on_cpu(mlp_step):
    a, b = Trainer(mlp_step, "cpu"), Trainer(mlp_step, "cpu")
    batches = random_batches(a, 12, 16)
    _same_run(a, b, a.step_many(batches, lr=1e-2), [b.step(x, lr=1e-2) for x in batches])
    assert a.step_many([]) == []
    assert not a.pipeline and a.pipeline_reason == "pipelining needs the cuda provider with CUDA graphs"


def test_lagged_step_many_is_step_per_batch(lagged, mlp_step):
    a, b = Trainer(mlp_step, "cpu"), Trainer(mlp_step, "cpu", pipeline=False)
    assert a.pipeline and a.executor.ring == len(a.executor.sets) == 3 and not b.pipeline and len(b.executor.sets) == 2
    batches = random_batches(a, 12, 16)
    _same_run(a, b, a.step_many(batches, lr=1e-2), [b.step(x, lr=1e-2) for x in batches])
    assert not a._inflight


@pytest.mark.parametrize("mode", ["skip", "ignore"])
def test_lagged_fit_undoes_bad_steps_like_fit(lagged, mlp_step, mode):
    """Over 3 epochs of 4 batches: a non-finite loss seen a step late undoes two steps and runs
    the second again; a NaN batch drains the step in flight before it is refused."""
    data = _bad_data()
    a, b = Trainer(mlp_step, "cpu"), Trainer(mlp_step, "cpu", pipeline=False)
    seen_a, seen_b = [], []
    a.fit(data, 12, 1e-2, batch_size=16, seed=1, on_nonfinite=mode, callback=lambda n, r: seen_a.append(n))
    b.fit(data, 12, 1e-2, batch_size=16, seed=1, on_nonfinite=mode, callback=lambda n, r: seen_b.append(n))
    _same_fit(a, b)
    assert seen_a == seen_b == list(range(1, 13))
    if mode == "skip":
        assert sum(a.metrics.skipped) == 6 and not a._inflight  # each bad sample once per epoch


def test_lagged_fit_stops_where_fit_stops(lagged, mlp_step):
    data = _bad_data()
    data["x"][40, 1] = 0.0  # only the overflow: the run stops at its first batch
    errors = []
    trainers = Trainer(mlp_step, "cpu"), Trainer(mlp_step, "cpu", pipeline=False)
    for t in trainers:
        with pytest.raises(TrainingError, match="the loss is (inf|nan)") as e:
            t.fit(data, 12, 1e-2, batch_size=16, seed=1)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    _same_fit(*trainers)
    assert all(np.isfinite(v).all() for v in trainers[0].state.values())


def test_lagged_checkpoint_in_the_callback_is_the_reported_step(lagged, mlp_step, tmp_path: Path):
    """A checkpoint written by the callback of step 5, with step 6 in flight, holds step 5: a
    run resumed from it ends where the uninterrupted run ends."""
    data, ckpt = _bad_data(), tmp_path / "c.npz"
    data["x"][5] = data["x"][40] = 1.0
    a = Trainer(mlp_step, "cpu")
    a.fit(data, 12, 1e-2, batch_size=16, seed=1,
          callback=lambda n, r: a.save_checkpoint(ckpt) if n == 5 else None)
    with np.load(ckpt) as z:
        meta = json.loads(z["__meta__"].tobytes())
    assert meta["steps"] == 5 and meta["data"]["epoch"] * 64 + meta["data"]["index"] == 5 * 16
    resumed = Trainer(mlp_step, "cpu", pipeline=False)
    resumed.load_checkpoint(ckpt)
    resumed.fit(data, 7, 1e-2, batch_size=16, seed=1)
    _same_fit(a, resumed)


def test_lagged_exception_in_the_callback_keeps_the_step_in_flight(lagged, mlp_step):
    data = _bad_data()
    data["x"][5] = data["x"][40] = 1.0
    full = Trainer(mlp_step, "cpu", pipeline=False)
    full.fit(data, 12, 1e-2, batch_size=16, seed=1)

    def fail_at_4(n: int, result: object) -> None:
        if n == 4:
            raise KeyboardInterrupt

    a = Trainer(mlp_step, "cpu")
    with pytest.raises(KeyboardInterrupt):
        a.fit(data, 12, 1e-2, batch_size=16, seed=1, callback=fail_at_4)
    assert a.steps == 5 and not a._inflight  # step 5 was in flight: it finished and counts
    a.fit(data, 7, 1e-2, batch_size=16, seed=1)
    _same_fit(a, full)


def test_pipeline_needs_cuda_graphs(mlp_step):
    with pytest.raises(UsageError, match="pipeline=True needs the cuda provider with CUDA graphs"):
        Trainer(mlp_step, "cpu", pipeline=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDAExecutionProvider")
@pytest.mark.parametrize("policy", ["fp32", "fp16"])
def test_pipelined_steps_are_the_same_bits(policy):
    """200 pipelined steps against 200 ``step`` calls from the same state: every loss, skip,
    loss scale and the final state bit for bit (fp16: dynamic loss scaling, from a scale high
    enough that the first steps overflow and skip)."""
    step = build_training_graph(MLP, optimizer="adamw", target="cuda")
    if policy == "fp16":
        fp16 = load_policy("fp16")
        fp16 = dataclasses.replace(fp16, loss_scaling=dataclasses.replace(fp16.loss_scaling, init=2.0**40))
        step = convert(step, fp16, emulate=False, validate=False, calibrate=None)
    piped, plain = Trainer(step, "cuda", pipeline=True), Trainer(step, "cuda", pipeline=False)
    batches = random_batches(plain, 200, 64)
    results = piped.step_many(batches)
    _same_run(piped, plain, results, [plain.step(x) for x in batches])
    assert piped.cuda_graph
    if policy == "fp16":
        assert any(r.skipped for r in results) and not all(r.skipped for r in results)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDAExecutionProvider")
@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_pipelined_fit_undoes_bad_steps_like_fit(mode):
    """40 steps of ``fit`` on CUDA graphs, pipelined (the default) and not, with a sample that
    overflows the loss once per epoch: the same steps undone, the same bits."""
    step = build_training_graph(MLP, optimizer="adamw", target="cuda")
    data = _bad_data()
    data["x"][40, 1] = 0.0
    piped, plain = Trainer(step, "cuda"), Trainer(step, "cuda", pipeline=False)
    assert piped.pipeline and not plain.pipeline
    for t in (piped, plain):
        if mode == "stop":
            t.fit(data, 20, 1e-2, batch_size=4, seed=2, on_nonfinite="skip")  # past the capture first
            with pytest.raises(TrainingError, match="the loss is (inf|nan)"):
                t.fit(data, 40, 1e-2, batch_size=4, seed=2)
        else:
            t.fit(data, 40, 1e-2, batch_size=4, seed=2, on_nonfinite=mode)
    _same_fit(piped, plain)
    assert piped.cuda_graph and sum(piped.metrics.skipped) >= 1



def test_pipeline_default_leaves_a_large_state_alone():
    """``pipeline=None`` adds no third state set over ``PIPELINE_MAX_STATE_MIB`` on CUDA (the
    reason names the size); an explicit choice and other providers are left as asked."""
    from mpgraph.runtime.executor import PIPELINE_MAX_STATE_MIB, _pipeline_default

    big = PIPELINE_MAX_STATE_MIB + 1.0
    pipeline, reason = _pipeline_default("cuda", None, big)
    assert pipeline is False and f"the state is {big:.0f} MiB" in reason and "pipeline=True forces it" in reason
    assert _pipeline_default("cuda", None, PIPELINE_MAX_STATE_MIB) == (None, "")
    assert _pipeline_default("cuda", True, big) == (True, "")
    assert _pipeline_default("cpu", None, big) == (None, "")


def test_lagged_exception_with_a_bad_step_in_flight_undoes_it(lagged, mlp_step):
    """The callback of step k raises while step k+1, whose loss is not finite, is in flight:
    step k+1 is finished and undone, and the trainer is where a plain run of k steps is."""
    data = _bad_data()
    data["x"][40, 1] = 0.0  # only the overflow
    probe = Trainer(mlp_step, "cpu", pipeline=False)
    probe.fit(data, 12, 1e-2, batch_size=16, seed=1, on_nonfinite="skip")
    bad = probe.metrics.step[probe.metrics.skipped.index(True)]
    assert bad > 1

    def fail_before_bad(n: int, result: object) -> None:
        if n == bad - 1:
            raise KeyboardInterrupt

    a = Trainer(mlp_step, "cpu")
    with pytest.raises(KeyboardInterrupt):
        a.fit(data, 12, 1e-2, batch_size=16, seed=1, callback=fail_before_bad)
    plain = Trainer(mlp_step, "cpu", pipeline=False)
    plain.fit(data, bad - 1, 1e-2, batch_size=16, seed=1)
    assert a.steps == bad - 1 and not a._inflight
    _same_fit(a, plain)
