"""Step time of several training step graphs on one provider, timed side by side.

Each graph gets a ``Trainer`` and the same random batch (float data ~ N(0, 1), integer labels in
[0, --classes)); the graphs are timed in alternating chunks, so the ratios come from one run.
Used to check on CUDA what a change to the emitted backward did to the step time::

    python3 benchmarks/gpu_step_ab.py old.onnx new.onnx [--batch 64] [--rounds 10] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnx_ir as ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def random_batch(trainer: Trainer, batch: int, classes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in trainer.data_inputs:
        shape = [batch if not isinstance(d, int) else d for d in (spec.shape or [batch])]
        if spec.dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, classes, shape).astype(spec.dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    trainers = [Trainer(ir.load(path), provider=args.provider) for path in args.models]
    batches = [random_batch(t, args.batch, args.classes) for t in trainers]
    for trainer, batch in zip(trainers, batches, strict=True):
        for _ in range(10):
            trainer.step(batch)
    times: list[list[float]] = [[] for _ in trainers]
    for _ in range(args.rounds):
        for trainer, batch, samples in zip(trainers, batches, times, strict=True):
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.step(batch)
            samples.append(1000 * (time.perf_counter() - start) / args.steps)
    base = statistics.median(times[0])
    for path, samples in zip(args.models, times, strict=True):
        median = statistics.median(samples)
        print(f"{os.path.basename(path):32s} {median:8.3f} ms/step  ({median / base:.2f}x the first)")


if __name__ == "__main__":
    main()
