"""compare on training step graphs: loss, gradients (unscaled), updates, first backward divergence, HTML."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import numpy as np
import pytest
from typer.testing import CliRunner

import mpgraph
from models.underflow import underflow_model
from mpgraph.audit.compare_train import compare_train, render_html
from mpgraph.cli.main import app
from mpgraph.policy import parse_policy


def _seeded_feeds() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The underflow model's batch and the tiny MLP's, drawn in this order from one seed at import
    (no generator is shared at run time, so the data does not depend on test order)."""
    rng = np.random.default_rng(0)
    underflow = {"x": rng.standard_normal((8, 16)).astype(np.float32), "t": rng.standard_normal((8, 4)).astype(np.float32)}
    mlp = {"x": rng.standard_normal((16, 4)).astype(np.float32), "label": rng.integers(0, 2, 16)}
    return underflow, mlp


FEEDS, MLP_FEEDS = _seeded_feeds()
NO_SCALING = "extends: fp16\nloss_scaling: {mode: none}\n"


def underflow_step(loss_factor: float | None = None):
    model = underflow_model(16, 4) if loss_factor is None else underflow_model(16, 4, tiny=loss_factor)
    return mpgraph.build_training_graph(model, optimizer="sgd", lr=1.0)


def converted(policy_text: str, loss_factor: float | None = None):
    return mpgraph.convert(underflow_step(loss_factor), parse_policy(policy_text, "p.yaml"), emulate=True, calibrate=None)


def test_fp16_without_scaling_names_the_backward_gemm_that_underflows():
    report = compare_train(underflow_step(), converted(NO_SCALING), FEEDS)
    assert report.scale == 1.0 and not report.found_inf
    assert report.loss_rel_error < 1e-3  # the forward is fine (measured 0: y = x @ 0)
    [grad] = report.gradients
    assert (grad.name, grad.rel_error, grad.underflow, grad.nonfinite) == ("W", 1.0, 1.0, 0)
    [update] = report.updates
    assert update.rel_error == 1.0 and update.underflow == 1.0
    first = report.first_backward_divergence
    assert first is not None and first.name == "grad/matmul/Gemm" and first.precision == "float16"
    assert first.producer == "Gemm 'grad/matmul/Gemm'" and first.underflow == 1.0
    # Every backward value before it (float32, dloss/dy ~1e-8) matches exactly.
    before = report.values[: report.values.index(first)]
    assert before and all(v.rel_error == 0.0 for v in before)


def test_dynamic_scaling_unscales_before_comparing():
    report = compare_train(underflow_step(), converted("extends: fp16\n"), FEEDS)
    assert report.scale == 65536.0 and report.first_backward_divergence is None
    [grad] = report.gradients
    assert grad.underflow == 0.0 and grad.rel_error < 2e-3  # measured 6.0e-4: fp16 rounding of x and dy
    backward = [v for v in report.values if v.role == "backward"]
    assert backward and max(v.rel_error for v in backward) < 2e-3


def test_overflowing_gradients_skip_the_update():
    """loss = 1e6 * mse: gradients ~1e6 times the scale 65536 overflow fp16; the step is skipped."""
    report = compare_train(underflow_step(1e6), converted("extends: fp16\n", 1e6), FEEDS)
    assert report.found_inf
    assert report.first_backward_divergence is not None and report.first_backward_divergence.nonfinite > 0
    [update] = report.updates
    assert update.rel_error == 1.0  # skipped: the candidate's update is zero
    assert "Infinity" not in report.to_json() and json.loads(report.to_json())["found_inf"] is True


def test_bf16_adamw_tiny_mlp_stays_close():
    step = mpgraph.build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw")
    low = mpgraph.convert(mpgraph.build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw"), "bf16",
                          emulate=True, calibrate=None)
    report = compare_train(step, low, MLP_FEEDS)
    assert report.scale == 1.0 and len(report.gradients) == len(report.updates) == 6
    assert report.loss_rel_error < 1e-3  # measured 1.5e-4
    assert max(g.rel_error for g in report.gradients) < 2e-2  # measured 5.6e-3 (bf16 has 8 bits)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        self.tags.append((tag, dict(attrs)))


def test_html_is_self_contained_with_one_mark_per_value():
    report = compare_train(underflow_step(), converted(NO_SCALING), FEEDS)
    page = render_html(report)
    parser = _Tags()
    parser.feed(page)
    tags = [t for t, _ in parser.tags]
    assert tags.count("circle") == len(report.values) and "svg" in tags
    assert not any(t in ("script", "link", "img", "iframe") for t in tags)
    assert not any(("src" in a or "href" in a) for _, a in parser.tags)
    assert "grad/matmul/Gemm" in page


def test_cli_json_and_html(tmp_path):
    ref, cand = tmp_path / "step.onnx", tmp_path / "step.fp16.onnx"
    mpgraph.save_model(underflow_step(), ref)
    mpgraph.save_model(converted(NO_SCALING), cand)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **FEEDS)
    page = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["compare", str(ref), str(cand), "--inputs", str(inputs), "--json", "--html", str(page)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["first_backward_divergence"]["name"] == "grad/matmul/Gemm"
    assert page.read_text().startswith("<!DOCTYPE html>")
    table = CliRunner().invoke(app, ["compare", str(ref), str(cand), "--inputs", str(inputs)])
    assert table.exit_code == 0 and "first backward divergence" in table.output


@pytest.mark.parametrize("swap", [False, True])
def test_refuses_mixed_graphs(swap):
    forward = mpgraph.load_model("models/onnx/tiny_mlp.loss.onnx")
    step = mpgraph.build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd")
    a, b = (forward, step) if swap else (step, forward)
    with pytest.raises(mpgraph.MpgraphError, match="not a training step graph"):
        compare_train(a, b, {})
