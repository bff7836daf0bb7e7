"""The Nature DQN's fp32 step on ORT CPU (2 threads) with mpgraph's fused kernels off and on.

The step graph of ``gpu_step.py``'s DQN (same seed, weights and batches); ``Trainer(kernels=False)``
against ``kernels=True`` (the CPU library: AdamW, its scalars and the Relu backwards fused),
timed side by side in alternating rounds of 10 steps after a warm-up round. Prints each
round's ms/step and the medians.

    python3 benchmarks/dqn_cpu_kernels_ab.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step as gs  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    spec = gs.dqn_spec()
    graph = gs.step_graphs(spec, False, ["fp32"])["fp32"]
    trainers = {k: Trainer(graph, "cpu", threads=2, kernels=k) for k in (False, True)}
    data = next(s.name for s in trainers[False].data_inputs if s.name != "label")
    times: dict[bool, list[float]] = {k: [] for k in trainers}
    for r in range(args.rounds + 1):
        for k, trainer in trainers.items():
            start = time.perf_counter()
            for i in range(10):
                trainer.step({data: spec.inputs[i % 4], "label": spec.labels[i % 4]})
            if r:
                times[k].append((time.perf_counter() - start) / 10 * 1e3)
    for k, t in times.items():
        print(f"kernels {'on ' if k else 'off'} ({trainers[k].kernels_fused} rewrites): median {np.median(t):.2f} ms/step, "
              f"rounds {', '.join(f'{x:.1f}' for x in t)}")
    print(f"on / off: {np.median(times[True]) / np.median(times[False]):.3f}")


if __name__ == "__main__":
    main()
