"""advise-scale: the recommended loss scale removes the underflow of the underflow model."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

import mpgraph
import mpgraph.advise
from models.underflow import underflow_model
from mpgraph.advise import advise_scale
from mpgraph.cli.main import app
from mpgraph.policy import parse_policy
from tests.cpu_runner import CpuRunner


def step_graph(loss_factor: float | None = None) -> ir.Model:
    """The underflow model's SGD step graph; ``loss_factor`` replaces its 1e-8 loss factor."""
    model = underflow_model(16, 4) if loss_factor is None else underflow_model(16, 4, tiny=loss_factor)
    return mpgraph.build_training_graph(model, optimizer="sgd", lr=1.0)


def batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, 16)).astype(np.float32), "t": rng.standard_normal((8, 4)).astype(np.float32)}
            for _ in range(n)]


def sgd_gradient(step, feeds) -> np.ndarray:
    """One SGD step with lr=1 from W=0: the new W is exactly -grad."""
    runner = CpuRunner(step)
    runner.step(feeds, lr=1.0)
    return -runner.state["W"]


def test_recommended_scale_removes_the_underflow():
    """Gradients ~1e-8 (loss = 1e-8 * mse): every backward entry flushes in fp16 unscaled; the
    recommended static scale leaves none flushed and gives float32's gradient."""
    advice = advise_scale(step_graph(), batches(3))
    assert {t.producer.split()[0] for t in advice.tensors} == {"Gemm", "Sum"}  # dW = x^T dy, and dy
    assert advice.flush_at[1.0] == 1.0  # all of them, unscaled
    assert advice.underflow_bound == 2.0**13  # measured: flush share 0.35% at 2**12, 0 at 2**13
    assert advice.recommended == 2.0**24 and not advice.dynamic
    feeds = batches(1, seed=7)[0]  # a batch the advice did not see
    ref = sgd_gradient(step_graph(), feeds)
    unscaled = mpgraph.convert(step_graph(), parse_policy("extends: fp16\nloss_scaling: {mode: none}\n", "a.yaml"),
                               emulate=True, calibrate=None)
    assert np.mean(sgd_gradient(unscaled, feeds) == 0) == 1.0
    scale = advice.recommended
    scaled = mpgraph.convert(
        step_graph(), parse_policy(f"extends: fp16\nloss_scaling: {{mode: static, init: {scale:g}}}\n", "b.yaml"),
        emulate=True, calibrate=None)
    got = sgd_gradient(scaled, feeds)
    assert np.count_nonzero(got == 0) == np.count_nonzero(ref == 0) == 0
    np.testing.assert_allclose(got, ref, rtol=1e-2)  # fp16 rounding of x and dy


def test_overflow_bound_keeps_the_headroom():
    """loss = 10 * mse: gradients of order 10; the largest safe scale leaves a margin of at least
    8 on every batch, and twice that scale would not."""
    advice = advise_scale(step_graph(10.0), batches(2), headroom=8.0)
    assert advice.underflow_bound == 1.0 and advice.flush_at[1.0] == 0.0
    peak = max(t.absmax for t in advice.tensors)
    s = advice.overflow_bound
    assert s is not None and 65504 / (peak * s) >= 8.0 > 65504 / (peak * 2 * s)
    assert advice.recommended == s and not advice.dynamic  # measured window 2**0 .. 2**10: wide


def test_gradients_that_overflow_unscaled_get_no_scale():
    advice = advise_scale(step_graph(1e6), batches(1))
    assert advice.overflow_bound is None and advice.recommended is None and advice.dynamic
    assert "overflow" in advice.reason


def test_refusals():
    with pytest.raises(mpgraph.MpgraphError, match="training step graph"):
        advise_scale(ir.from_proto(underflow_model(4, 2)), batches(1))
    with pytest.raises(mpgraph.MpgraphError, match="at least one batch"):
        advise_scale(step_graph(), [])
    with pytest.raises(mpgraph.MpgraphError, match="float32 step graph"):
        advise_scale(mpgraph.convert(step_graph(), "fp16", calibrate=None), batches(1))


def test_cli_splits_a_data_file_into_batches(tmp_path):
    path = tmp_path / "step.onnx"
    mpgraph.save_model(step_graph(), path)
    data = tmp_path / "data.npz"
    both = batches(1)[0]
    np.savez(data, x=np.concatenate([both["x"]] * 3), t=np.concatenate([both["t"]] * 3))
    result = CliRunner().invoke(app, ["advise-scale", str(path), "--data", str(data), "--batches", "3", "--json"])
    assert result.exit_code == 0, result.output
    advice = json.loads(result.output)
    assert advice["batches"] == 3 and advice["recommended"] == 2.0**24
    table = CliRunner().invoke(app, ["advise-scale", str(path), "--data", str(data)])
    assert table.exit_code == 0 and "recommended initial scale: 16777216 (2**24), static scaling" in table.output


def test_doctests():
    result = doctest.testmod(mpgraph.advise)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(("args", "phrase"), [
    (["advise-scale", "nope.onnx"], "no such file"),
    (["advise-scale", "models/onnx/tiny_mlp.loss.onnx"], "needs a training step graph"),
    (["advise-scale", "STEP", "--batches", "0"], "--batches must be >= 1"),
    (["advise-scale", "STEP", "--max-flush", "nan"], "--max-flush must be a finite number"),
    (["advise-scale", "STEP", "--headroom", "0.5"], "--headroom must be >= 1"),
    (["advise-scale", "STEP", "--data", "DATA", "--batches", "100"], "fewer than 100"),
    (["advise-scale", "STEP", "--policy", "fp32"], "lowers no backward value"),
])
def test_cli_bad_input_is_one_error_line(args, phrase, tmp_path):
    step = tmp_path / "step.onnx"
    mpgraph.save_model(step_graph(), step)
    data = tmp_path / "data.npz"
    np.savez(data, **batches(1)[0])
    root = Path(__file__).parents[1]
    subst = {"STEP": str(step), "DATA": str(data), "nope.onnx": str(tmp_path / "nope.onnx")}
    args = [subst.get(a, str(root / a) if a.startswith("models/") else a) for a in args]
    before = sorted(tmp_path.iterdir())
    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and phrase in errors[0], result.output
    assert sorted(tmp_path.iterdir()) == before
