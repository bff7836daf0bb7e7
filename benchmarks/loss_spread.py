"""How far apart the same configuration's loss lands across runs of ``gpu_step.py``.

"mpgraph's loss within 1% of its torch twin" is a meaningful test only where torch's own
loss, seeded the same way, lands within 1% of itself from run to run. This script reads the
JSON files that ``gpu_step.py --out`` wrote and prints, per model and configuration, the loss
after ``--check-step`` steps in every file, its spread over the files ((max - min) / min), and
each mpgraph row's relative difference to its twin in each file.

    python3 benchmarks/loss_spread.py benchmarks/results/gpu_step_2026-12-01T{14,17,23}*.json --models dqn_cnn,dqn_cnn_teacher
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def collect(paths: list[str], models: set[str] | None) -> dict[str, dict[str, list[tuple[str, float, float | None]]]]:
    """``{model: {config: [(file, loss, rel diff to twin or None), ...]}}`` over the files."""
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for m in data["models"]:
            if models and m["model"] not in models:
                continue
            for row in m["rows"]:
                loss = next((v for k, v in row.items() if k.startswith("loss_at_")), None)  # --check-step's
                if loss is None or loss != loss:  # missing or NaN (the cuda-graph row keeps none)
                    continue
                out[m["model"]][row["config"]].append((path, loss, row.get("rel_loss_diff_to_twin")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="gpu_step.py JSON outputs")
    p.add_argument("--models", default="", help="comma-separated; default all")
    args = p.parse_args()
    table = collect(args.files, set(filter(None, args.models.split(","))) or None)
    for model, configs in table.items():
        print(f"== {model} ==")
        print(f"{'config':24s} {'runs':>4s} {'min':>11s} {'max':>11s} {'spread':>8s}  {'worst |d twin|':>14s}")
        for config, runs in configs.items():
            losses = [loss for _, loss, _ in runs]
            diffs = [d for _, _, d in runs if d is not None]
            lo, hi = min(losses), max(losses)
            worst = f"{max(diffs):14.2e}" if diffs else f"{'-':>14s}"
            print(f"{config:24s} {len(runs):4d} {lo:11.5g} {hi:11.5g} {(hi - lo) / lo:8.2%}  {worst}")
        print()


if __name__ == "__main__":
    main()
