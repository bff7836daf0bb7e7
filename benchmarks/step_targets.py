"""Judge one ``gpu_step.py`` run against the "Done means" lines of issue 11 ("Mixed precision
that pays on the GPU"), from its JSON alone.

Each line is a ratio (or a count) measured in that run, its limit, and whether it held. A line
whose rows are missing from the run (a model not asked for, a CPU-only run) is reported as
``n/a``, never as held. The loss line is judged on the teacher-target DQN when the run has it:
the random-target DQN's loss@50 moves by up to 12% between torch's own runs
(``benchmarks/results/dqn_loss_spread.txt``), so 1% cannot be judged there.

    python3 benchmarks/step_targets.py benchmarks/results/gpu_step_2026-12-01T23.json

``gpu_step.py`` prints the same table at the end of every run.
"""

from __future__ import annotations

import argparse
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The loss line's tolerance: |mpgraph - twin| / |twin| after ``--check-step`` steps.
LOSS_TOLERANCE = 0.01


@dataclass(frozen=True)
class Verdict:
    line: str
    value: float | None  # None: the run lacks the rows this line needs
    limit: float
    held: bool | None


def _ms(model: Mapping[str, Any], config: str) -> float | None:
    row = next((r for r in model["rows"] if r["config"] == config), None)
    value = row.get("ms_per_step") if row else None
    return value if value is not None and value == value else None  # NaN: the row failed


def _ratio(models: Mapping[str, Mapping[str, Any]], model: str, a: str, b: str) -> float | None:
    m = models.get(model)
    if m is None:
        return None
    x, y = _ms(m, a), _ms(m, b)
    return x / y if x is not None and y else None


def _judge(line: str, value: float | None, limit: float, ok: Callable[[float, float], bool]) -> Verdict:
    return Verdict(line, value, limit, None if value is None else bool(ok(value, limit)))


def _worst_loss(model: Mapping[str, Any] | None) -> float | None:
    """The largest relative loss difference of the model's mpgraph rows against their twins."""
    if model is None:
        return None
    diffs = [r["rel_loss_diff_to_twin"] for r in model["rows"]
             if r["config"].startswith("mpgraph") and r.get("rel_loss_diff_to_twin") is not None]
    return max(diffs) if diffs else None


def verdicts(run: Mapping[str, Any]) -> list[Verdict]:
    """Every Done-means line of issue 11, judged on ``run`` (``gpu_step.py``'s JSON)."""
    models = {m["model"]: m for m in run["models"]}
    le, ge, lt = operator.le, operator.ge, operator.lt
    out = [
        _judge("GPT bf16 / torch AMP bf16", _ratio(models, "gpt", "mpgraph bf16", "torch amp bf16"), 1.0, le),
        _judge("GPT strict fp32 / bf16", _ratio(models, "gpt", "mpgraph fp32", "mpgraph bf16"), 2.5, ge),
        _judge("GPT tf32 / bf16", _ratio(models, "gpt", "mpgraph tf32", "mpgraph bf16"), 1.4, ge),
        _judge("GPT fp16 / bf16", _ratio(models, "gpt", "mpgraph fp16", "mpgraph bf16"), 1.10, le),
    ]
    for model, label in (("tiny_mlp", "tiny MLP"), ("dqn_cnn", "DQN")):
        for policy in ("fp32", "bf16"):
            value = _ratio(models, model, f"mpgraph {policy}", "torch cuda-graph step")
            out.append(_judge(f"{label} {policy} / torch whole-step CUDA graph", value, 1.5, le))
    out.append(_judge("tiny MLP fp32: CUDA / ORT CPU", _ratio(models, "tiny_mlp", "mpgraph fp32", "mpgraph fp32 cpu2"), 1.0, lt))
    out.append(_judge("DQN CPU, 2 threads: mpgraph / torch", _ratio(models, "dqn_cnn", "mpgraph fp32 cpu2", "torch fp32 cpu2"), 1.0, le))
    dqn = "dqn_cnn_teacher" if "dqn_cnn_teacher" in models else "dqn_cnn"
    for model in ("gpt", "tiny_mlp", dqn):
        out.append(_judge(f"{model} loss@check within 1% of its twin (worst row)", _worst_loss(models.get(model)),
                          LOSS_TOLERANCE, le))
    kernels = models.get("gpt", {}).get("kernels", {}).get("mpgraph bf16", {}).get("kernels_per_step")
    out.append(_judge("GPT bf16 kernels per step", kernels, 700, le))
    return out


def table(results: Sequence[Verdict]) -> str:
    lines = [f"{'Done means (issue 11)':<60} {'value':>9} {'limit':>7}  verdict"]
    for v in results:
        if v.value is None:
            shown = f"{'-':>9}"
        else:
            shown = f"{v.value:9.4f}" if v.value < 100 else f"{v.value:9.0f}"
        verdict = "n/a" if v.held is None else ("held" if v.held else "MISSED")
        lines.append(f"{v.line:<60} {shown} {v.limit:7.2f}  {verdict}")
    judged = [v for v in results if v.held is not None]
    lines.append(f"{sum(v.held for v in judged)} of {len(judged)} judged lines held; {len(results) - len(judged)} n/a")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a gpu_step.py JSON output")
    args = p.parse_args()
    with open(args.run) as f:
        print(table(verdicts(json.load(f))))


if __name__ == "__main__":
    main()
