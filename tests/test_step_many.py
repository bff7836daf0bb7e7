"""``Trainer.step_many``: one step per batch with the same results as ``step`` on each; on CUDA
with ``pipeline=True`` the steps are enqueued ahead of the host's loss reads (issue 11: never a
sync per step). CPU runs check the semantics; the GPU tests check the pipelined path's bits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from mpgraph.convert import convert
from mpgraph.errors import UsageError
from mpgraph.policy import load_policy
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "models/onnx/tiny_mlp.loss.onnx"
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def _batches(trainer: Trainer, count: int, batch: int = 16) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        feeds = {}
        for spec in trainer.data_inputs:
            shape = [d if isinstance(d, int) else batch for d in spec.shape]
            feeds[spec.name] = (rng.standard_normal(shape) if spec.dtype.kind == "f" else rng.integers(0, 2, shape)).astype(spec.dtype)
        out.append(feeds)
    return out


def _same_run(a: Trainer, b: Trainer, results_a: list, results_b: list) -> None:
    assert [r.loss for r in results_a] == [r.loss for r in results_b]
    assert [r.skipped for r in results_a] == [r.skipped for r in results_b]
    assert [r.loss_scale for r in results_a] == [r.loss_scale for r in results_b]
    assert a.steps == b.steps and a.metrics.step == b.metrics.step and a.metrics.loss == b.metrics.loss
    sa, sb = a.state, b.state
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


def test_step_many_is_step_per_batch_on_cpu():
    step = build_training_graph(MLP, optimizer="adamw")
    a, b = Trainer(step, "cpu"), Trainer(step, "cpu")
    batches = _batches(a, 12)
    _same_run(a, b, a.step_many(batches, lr=1e-2), [b.step(x, lr=1e-2) for x in batches])
    assert a.step_many([]) == []


def test_pipeline_needs_cuda_graphs():
    step = build_training_graph(MLP, optimizer="adamw")
    with pytest.raises(UsageError, match="pipeline=True needs the cuda provider with CUDA graphs"):
        Trainer(step, "cpu", pipeline=True)


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
    piped, plain = Trainer(step, "cuda", pipeline=True), Trainer(step, "cuda")
    batches = _batches(plain, 200, batch=64)
    results = piped.step_many(batches)
    _same_run(piped, plain, results, [plain.step(x) for x in batches])
    assert piped.cuda_graph
    if policy == "fp16":
        assert any(r.skipped for r in results) and not all(r.skipped for r in results)
