"""The zoo's step graphs on ORT CPU with the kernel lowering off, at the CPU default, and all of
it (``Trainer(kernels=False | None | True)``), side by side in one process.

For each zoo model (``models/onnx/*.loss.onnx``) it builds the AdamW step graph, makes the three
Trainers at ``--threads`` threads, and times them in alternating rounds of ``--steps`` steps on
the same seeded batches after a warm-up round. Prints each one's rewrites, median and minimum
ms/step, the ratios to ``off``, and the loss after all rounds (the three take the same batches
in the same order, so the losses agree to float32 rounding).

    python3 benchmarks/cpu_lowering_ab.py [--models tiny_mlp,dqn_cnn,gpt,resnet] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "onnx")
BATCH = {"tiny_mlp": 64, "dqn_cnn": 32, "gpt": 8, "resnet": 32, "wide_mlp": 256}


def _batches(trainer: Trainer, batch: int, count: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        feeds = {}
        for spec in trainer.data_inputs:
            shape = [d if isinstance(d, int) else batch for d in (spec.shape or [batch])]
            if spec.dtype.kind == "f":
                feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
            else:  # class labels / token ids: below the smallest vocabulary in the zoo
                feeds[spec.name] = rng.integers(0, 2, shape).astype(spec.dtype)
        out.append(feeds)
    return out


def run(model: str, threads: int, steps: int, rounds: int) -> None:
    step = build_training_graph(os.path.join(ZOO, f"{model}.loss.onnx"), optimizer="adamw")
    trainers = {k: Trainer(step, "cpu", threads=threads, kernels=v) for k, v in (("off", False), ("default", None), ("all", True))}
    batches = _batches(trainers["off"], BATCH.get(model, 32))
    times: dict[str, list[float]] = {k: [] for k in trainers}
    loss: dict[str, float] = {}
    for r in range(rounds + 1):
        for k, trainer in trainers.items():
            start = time.perf_counter()
            for i in range(steps):
                loss[k] = trainer.step(batches[i % len(batches)]).loss
            if r:
                times[k].append((time.perf_counter() - start) / steps * 1e3)
    med = {k: float(np.median(t)) for k, t in times.items()}
    print(f"\n{model} (batch {BATCH.get(model, 32)}, {threads} threads, {rounds} rounds of {steps} steps)")
    for k, t in times.items():
        print(f"  {k:8s} {trainers[k].kernels_fused:4d} rewrites  median {med[k]:8.3f} ms  min {min(t):8.3f}  "
              f"/ off {med[k] / med['off']:.3f}  loss {loss[k]:.7g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny_mlp,dqn_cnn,gpt,resnet")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    for model in args.models.split(","):
        run(model, args.threads, args.steps, args.rounds)


if __name__ == "__main__":
    main()
