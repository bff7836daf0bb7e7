"""tune: the fewest ops kept float32 so an objective holds, written as a policy."""

from __future__ import annotations

import dataclasses
import doctest
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

import mpgraph
import mpgraph.tune
from mpgraph._ir import meta as md
from mpgraph.cli.main import app
from mpgraph.policy import load_policy
from mpgraph.tune import (
    GradientTolerance,
    LossAfterSteps,
    OutputTolerance,
    parse_objective,
    relative_error,
    tune,
)
from tests.helpers import run

PLANTED = "node_MatMul_57"  # the zoo GPT's first MLP output projection (blocks.0.out)


def planted_gpt(factor: float = 1e5) -> onnx.ModelProto:
    """The zoo GPT with ``blocks.0.out.weight`` scaled: that MatMul's output (|x| up to ~0.7
    unscaled) passes float16's 65504, as pretrained T5's feed-forward outputs do; the residual
    stream's LayerNorms bring it back, so float32 outputs stay finite."""
    model = onnx.load("models/onnx/gpt.onnx")
    for init in model.graph.initializer:
        if init.name == "blocks.0.out.weight":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), init.name))
    return model


FEEDS = {"tokens": np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int64)}


def emulated_error(model: onnx.ModelProto, policy) -> float:
    """The policy as written, without convert's range check (tune searches without it too)."""
    got = run(mpgraph.convert(ir.from_proto(model), policy, emulate=True, calibrate=None), FEEDS)[0]
    return relative_error(run(model, FEEDS)[0], got)


def test_keeps_exactly_the_planted_overflowing_op_and_the_policy_reproduces_it(tmp_path):
    model = planted_gpt()
    result = tune(model, "fp16", objective=OutputTolerance(2e-3), feeds=FEEDS)
    assert result.kept == [PLANTED] and result.kept_ops == ["MatMul"]
    assert result.error_before == float("inf") and result.met
    assert result.error_after < 1e-3  # measured 5.4e-4, fp16's rounding with the op float32
    assert result.seconds < 60 and result.evaluations <= 5  # the bound; measured 0.3-0.8 s, 3 conversions
    path = tmp_path / "tuned.yaml"
    path.write_text(result.policy_yaml())
    policy = load_policy(str(path))
    assert policy.name == "fp16-tuned" and [o.pattern for o in policy.overrides] == [PLANTED]
    assert emulated_error(model, policy) == pytest.approx(result.error_after, rel=1e-3)  # tune runs ORT unoptimized
    assert emulated_error(model, "fp16") == float("inf")


def test_a_model_that_already_meets_the_objective_keeps_nothing():
    result = tune(onnx.load("models/onnx/gpt.onnx"), "fp16", feeds=FEEDS)
    assert result.kept == [] and result.evaluations == 1 and result.met


def test_a_tight_objective_gives_a_set_where_no_kept_op_can_go():
    """Tolerance 1e-4 on the planted GPT (fp16 rounding alone gives 5e-4): several MatMuls must
    stay float32, and dropping any one of them breaks the objective again."""
    model = planted_gpt()
    result = tune(model, "fp16", objective=OutputTolerance(1e-4), feeds=FEEDS)
    assert result.met and PLANTED in result.kept and 1 < len(result.kept) < result.candidates
    base = load_policy("fp16")
    for name in result.kept:
        others = [n for n in result.kept if n != name]
        policy = mpgraph.policy.parse_policy(
            "extends: fp16\noverrides:\n" + "".join(f"  - {{match: '{n}', precision: float32}}\n" for n in others),
            "t.yaml")
        assert base.dtype == policy.dtype
        assert emulated_error(model, policy) > 1e-4, name


@dataclasses.dataclass(frozen=True)
class KeepsFloat32:
    """An objective on which nodes a candidate computes in float32, not on its numbers: met
    (error 0) when every node of one of ``ways`` does."""

    ways: tuple[frozenset[str], ...]
    tol: float = 0.5

    def describe(self) -> str:
        return "one of the given node sets float32"

    def bind(self, reference: ir.Model, feeds: Mapping[str, np.ndarray]) -> Callable[[ir.Model], float]:
        def error(candidate: ir.Model) -> float:
            float32 = {n.name for n in candidate.graph if n.metadata_props.get(md.NODE_PRECISION) == "float32"}
            return 0.0 if any(way <= float32 for way in self.ways) else 1.0

        return error


def test_minimisation_drops_a_kept_op_that_a_later_one_made_unneeded():
    """Phase 4 at work on the planted GPT. The objective is met by keeping float32 either the
    planted MatMul P and the second lowered MatMul b, or the first three, a, b and c (MatMuls:
    keeping one float32 moves no other). Bisection keeps c (the shortest prefix that holds ends
    there), then b (with c kept, the prefix ending at b holds); compare's suspect, P, then meets
    the objective with {b, c, P}, where c is no longer needed: minimisation drops it."""
    model = planted_gpt()
    first = mpgraph.convert(ir.from_proto(model), "fp16", emulate=True, calibrate=None)
    matmuls = [n.name for n in first.graph if n.op_type == "MatMul" and n.metadata_props.get(md.NODE_PRECISION) == "float16"]
    a, b, c = matmuls[:3]
    assert PLANTED not in (a, b, c)
    objective = KeepsFloat32((frozenset({b, PLANTED}), frozenset({a, b, c})))
    result = tune(model, "fp16", objective=objective, feeds=FEEDS)
    assert result.met and result.kept == [b, PLANTED]  # without phase 4: [b, c, PLANTED]


def test_loss_objective_on_a_training_step_graph():
    """The underflow model's gradients (~1e-8) vanish in fp16 without loss scaling: after 3 SGD
    steps the weights have not moved; keeping the weight-gradient Gemm float32 fixes it."""
    from models.underflow import underflow_model

    step = mpgraph.build_training_graph(underflow_model(16, 4), optimizer="sgd", lr=1e6)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((8, 16)).astype(np.float32), "t": rng.standard_normal((8, 4)).astype(np.float32)}
    policy = mpgraph.policy.parse_policy("extends: fp16\nloss_scaling: {mode: none}\n", "noscale.yaml")
    result = tune(step, policy, objective=LossAfterSteps(3, 1e-3), feeds=feeds)
    assert result.met and result.error_before > 1e-3
    assert result.kept == ["grad/matmul/Gemm"]  # x^T @ dloss/dy, the weight gradient


def test_gradient_objective_on_a_training_step_graph():
    """The same model, objective "every gradient within 1e-2 after one step": same single op."""
    from models.underflow import underflow_model

    step = mpgraph.build_training_graph(underflow_model(16, 4), optimizer="sgd", lr=1.0)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((8, 16)).astype(np.float32), "t": rng.standard_normal((8, 4)).astype(np.float32)}
    policy = mpgraph.policy.parse_policy("extends: fp16\nloss_scaling: {mode: none}\n", "noscale.yaml")
    result = tune(step, policy, objective=GradientTolerance(1e-2), feeds=feeds)
    assert result.error_before == 1.0  # every gradient entry flushed
    assert result.kept == ["grad/matmul/Gemm"] and result.error_after < 1e-2 and result.evaluations <= 5


def test_doctests():
    result = doctest.testmod(mpgraph.tune)
    assert result.attempted > 0 and result.failed == 0


def test_objective_parsing_and_refusals():
    assert parse_objective("output") == OutputTolerance()
    assert parse_objective("loss:4") == LossAfterSteps(4)
    assert parse_objective("grad") == GradientTolerance()
    for bad in ("outputs:1", "output:x", "loss:0", "loss:1:2:3", "grad:1:2"):
        with pytest.raises(mpgraph.MpgraphError, match="bad objective"):
            parse_objective(bad)
    with pytest.raises(mpgraph.MpgraphError, match="low-precision policy"):
        tune(onnx.load("models/onnx/gpt.onnx"), "fp32")
    with pytest.raises(mpgraph.MpgraphError, match="already converted"):
        tune(mpgraph.convert(ir.from_proto(onnx.load("models/onnx/gpt.onnx")), "fp16"), "fp16")


def test_cli_writes_the_policy(tmp_path):
    path = tmp_path / "planted.onnx"
    onnx.save(planted_gpt(), path)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **FEEDS)
    result = CliRunner().invoke(app, ["tune", str(path), "--policy", "fp16", "--inputs", str(inputs)])
    assert result.exit_code == 0, result.output
    written = tmp_path / "planted.fp16.tuned.yaml"
    assert PLANTED in written.read_text() and "written by mpgraph tune in" in written.read_text()
    assert re.search(r"with 1 of \d+ lowered ops kept float32", result.output)


@pytest.mark.parametrize(("args", "phrase"), [
    (["tune", "nope.onnx"], "no such file"),
    (["tune", "models/onnx/gpt.onnx", "--objective", "speed"], "bad objective 'speed'"),
    (["tune", "models/onnx/gpt.onnx", "--policy", "fp32"], "low-precision policy"),
    (["tune", "models/onnx/gpt.onnx", "--max-evals", "2"], "--max-evals must be >= 3"),
    (["tune", "models/onnx/gpt.onnx", "--objective", "loss:3"], "needs a training step graph"),
    (["tune", "models/onnx/gpt.onnx", "--inputs", "missing.npz"], "no such file"),
])
def test_cli_bad_input_is_one_error_line(args, phrase, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [a if not a.startswith("models/") else str(Path(__file__).parents[1] / a) for a in args]
    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and phrase in errors[0], result.output
    assert list(tmp_path.iterdir()) == []
