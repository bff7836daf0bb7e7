"""``benchmarks/step_targets.py`` judges a ``gpu_step.py`` run against issue 11's Done means.

Checked on the committed H200 runs, whose verdicts are known from their printed tables, and
on runs with rows taken away (a line without its rows is ``n/a``, never held).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_spec = importlib.util.spec_from_file_location("step_targets", ROOT / "benchmarks" / "step_targets.py")
step_targets = importlib.util.module_from_spec(_spec)
sys.modules["step_targets"] = step_targets  # dataclasses look their module up there
_spec.loader.exec_module(step_targets)


def _run(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _by_line(run: dict) -> dict:
    return {v.line: v for v in step_targets.verdicts(run)}


def test_first_run_at_6f83dae_holds_every_line():
    verdicts = step_targets.verdicts(_run("gpu_step_2026-12-01T23.json"))
    assert len(verdicts) == 14 and all(v.held for v in verdicts)
    lines = _by_line(_run("gpu_step_2026-12-01T23.json"))
    assert lines["GPT bf16 / torch AMP bf16"].value == pytest.approx(13.668 / 32.600, abs=1e-3)
    assert lines["GPT bf16 kernels per step"].value == 670


def test_third_run_at_98de5d0_misses_only_the_teacher_fp16_loss():
    lines = _by_line(_run("gpu_step_2026-12-01T23_c.json"))
    missed = [v for v in lines.values() if v.held is False]
    assert [v.line for v in missed] == ["dqn_cnn_teacher loss@check within 1% of its twin (worst row)"]
    assert missed[0].value == pytest.approx(0.0106, abs=2e-4)


def test_without_the_teacher_the_random_target_dqn_is_judged():
    """The third run of 2026-12-01T17 (at 3666aba) had no teacher model: its random-target DQN missed by 6%."""
    lines = _by_line(_run("gpu_step_2026-12-01T17_c.json"))
    assert lines["dqn_cnn loss@check within 1% of its twin (worst row)"].held is False
    assert sum(v.held is False for v in lines.values()) == 1


def test_missing_rows_are_not_applicable():
    run = _run("gpu_step_2026-12-01T23.json")
    no_gpt = copy.deepcopy(run)
    no_gpt["models"] = [m for m in run["models"] if m["model"] != "gpt"]
    lines = _by_line(no_gpt)
    gpt_lines = [v for k, v in lines.items() if k.startswith(("GPT", "gpt"))]
    assert len(gpt_lines) == 6 and all(v.held is None and v.value is None for v in gpt_lines)
    failed = copy.deepcopy(run)
    tiny = next(m for m in failed["models"] if m["model"] == "tiny_mlp")
    next(r for r in tiny["rows"] if r["config"] == "torch cuda-graph step")["ms_per_step"] = float("nan")
    lines = _by_line(failed)
    assert lines["tiny MLP fp32 / torch whole-step CUDA graph"].held is None
    assert "n/a" in step_targets.table(step_targets.verdicts(failed))
