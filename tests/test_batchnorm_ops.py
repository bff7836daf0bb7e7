"""train-graph --batchnorm train-ops: BatchNormalization as explicit ops (ORT CUDA refuses the
training-mode node at opset >= 14); it must compute exactly what the node computes."""

from __future__ import annotations

import json

import numpy as np

import mpgraph
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner

RESNET = "models/onnx/resnet.loss.onnx"


def _run(batchnorm: str, steps: int = 3):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 3, 32, 32)).astype(np.float32), "label": rng.integers(0, 10, 5).astype(np.int64)}
    step = build_training_graph(RESNET, optimizer="sgd", lr=0.1, batchnorm=batchnorm)
    runner = CpuRunner(step, threads=1)
    losses = [runner.step(feeds) for _ in range(steps)]
    return step, losses, runner.state


def test_train_ops_matches_the_batchnorm_node():
    node_step, node_losses, node_state = _run("train")
    ops_step, ops_losses, ops_state = _run("train-ops")
    assert not any(n.op_type == "BatchNormalization" for n in ops_step.graph)
    assert sum(n.op_type == "BatchNormalization" for n in node_step.graph) == 9
    pairs = json.loads(ops_step.metadata_props["mpgraph.state_pairs"])
    assert {a for a, _ in pairs} == {a for a, _ in json.loads(node_step.metadata_props["mpgraph.state_pairs"])}
    np.testing.assert_allclose(ops_losses, node_losses, rtol=1e-5)
    for name, value in node_state.items():
        np.testing.assert_allclose(ops_state[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    # Running statistics really move (they are state, updated every step).
    assert not np.allclose(ops_state["bn.running_mean"], 0)


def test_train_ops_converts_and_trains_emulated():
    """bf16 (emulated) train-ops fits one batch as float32 does: 10 AdamW steps take the loss from
    2.21 to 0.64 in both (measured: per-step losses within 1.1e-3 of each other)."""
    step = build_training_graph(RESNET, optimizer="adamw", batchnorm="train-ops")
    low = mpgraph.convert(step, "bf16", emulate=True)
    reasons = {n.metadata_props.get("mpgraph.reason", "") for n in low.graph}
    assert any("deny" in r for r in reasons)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((8, 3, 32, 32)).astype(np.float32), "label": rng.integers(0, 10, 8).astype(np.int64)}
    fp32, bf16 = CpuRunner(step, threads=1), CpuRunner(low, threads=1)
    ref = np.array([fp32.step(feeds) for _ in range(10)])
    losses = np.array([bf16.step(feeds) for _ in range(10)])
    assert losses[-1] < 0.4 * losses[0]  # measured 0.29
    np.testing.assert_allclose(losses, ref, atol=5e-3)


def test_cli_says_which_form_runs_on_cuda(tmp_path) -> None:
    """The default node form runs on ORT CPU only; the CLI says so and names the CUDA form."""
    from typer.testing import CliRunner

    from mpgraph.cli.main import app

    runner = CliRunner()
    node = runner.invoke(app, ["train-graph", RESNET, "-o", str(tmp_path / "a.onnx"), "--optimizer", "sgd"])
    assert node.exit_code == 0, node.output
    assert "9 BatchNormalization nodes" in node.output and "--batchnorm train-ops" in node.output
    ops = runner.invoke(app, ["train-graph", RESNET, "-o", str(tmp_path / "b.onnx"), "--optimizer", "sgd",
                              "--batchnorm", "train-ops"])
    assert ops.exit_code == 0 and "note:" not in ops.output
