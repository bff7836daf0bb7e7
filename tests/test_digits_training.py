"""Mixed precision trains digits as well as fp32 on CPU (emulated): MLP and CNN, three ways each.

A shorter run of ``benchmarks/train_digits.py`` (same models, seeds, optimizer and data order):
bf16 without loss scaling and fp16 with dynamic loss scaling, both CPU-emulated lowerings,
must reach fp32's test accuracy within one percentage point.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import load_benchmark

pytest.importorskip("torch")
pytest.importorskip("sklearn")

STEPS = {"mlp": 250, "cnn": 150}
BATCH = 64
THREADS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], object]:
    bench = load_benchmark("train_digits")
    folder = str(tmp_path_factory.mktemp("digits"))
    out = {}
    for model in bench.MODELS:
        loss_model = bench.export(model, folder)
        for policy in bench.POLICIES:
            out[model, policy] = bench.train(loss_model, model, policy, steps=STEPS[model], batch=BATCH, threads=THREADS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_fp32_learns(runs, model):
    r = runs[model, "fp32"]
    assert len(r.metrics) == STEPS[model]
    assert r.metrics.loss[-1] < 0.1 * r.metrics.loss[0]
    assert r.accuracy > 0.93, r.accuracy


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_low_precision_matches_fp32(runs, model, policy):
    base, r = runs[model, "fp32"], runs[model, policy]
    assert len(r.metrics) == len(base.metrics) == STEPS[model]
    assert abs(r.accuracy - base.accuracy) <= 0.01, (model, policy, r.accuracy, base.accuracy)
    assert math.isfinite(r.metrics.loss[-1])
    assert r.metrics.loss[-1] < 0.1 * r.metrics.loss[0]
    # Really a different computation: the same batches give (slightly) different losses.
    diff = np.abs(np.asarray(r.metrics.loss) - np.asarray(base.metrics.loss))
    assert diff.max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_loss_scaling_reported(runs, model):
    fp16, bf16 = runs[model, "fp16"], runs[model, "bf16"]
    # fp16: dynamic loss scaling, every step reports its scale and whether it was skipped.
    summary = fp16.metrics.summary()
    assert isinstance(summary["skipped"], int) and 0 <= summary["skipped"] < STEPS[model] // 10
    assert len(fp16.metrics.skipped) == STEPS[model]
    scales = fp16.metrics.loss_scale
    assert all(s is not None and math.isfinite(s) and s > 0 for s in scales)
    assert scales[0] == 65536.0  # torch.amp.GradScaler's initial scale
    assert math.isfinite(fp16.metrics.loss[-1])
    # bf16: no loss scaling, nothing skipped.
    assert all(s is None for s in bf16.metrics.loss_scale)
    assert bf16.skipped == 0
