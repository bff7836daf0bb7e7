"""The Nature DQN's fp32 step on ORT CPU (2 threads): mpgraph's CPU lowerings against none, and
against torch on the same 2 threads, side by side in one process.

The step graph of ``gpu_step.py``'s DQN (same seed, weights and batches), run by the ``Trainer``
three ways:

- ``kernels=False``: the step graph as saved;
- ``kernels=None``: what a user gets, the CPU default (``kernels.lower(scope="default")``:
  ORT's NCHWc convolutions, the multi-tensor AdamW and the Relu backward);
- ``kernels=True``: everything ``kernels.lower`` has (here the same rewrites: the DQN has no
  LayerNorm, GELU or softmax);

and torch's eager step (``gpu_step.torch_run``, AdamW as torch picks it on CPU), all timed in
alternating rounds of 10 steps after a warm-up round. Prints each round's ms/step, the medians,
the ratios, and each run's loss after the timed steps against torch's (all runs take the same
batches in the same order).

    python3 benchmarks/dqn_cpu_kernels_ab.py [--rounds 7] [--no-all] [--dw-form conv] [--previous]

``--dw-form FORM`` adds a run of the CPU default on a step graph whose weight gradients are all
built in FORM (``mpgraph.autodiff.rules.pool_conv.weight_grad_form``): on the DQN, ``conv``
changes only the 3x3/1 layer's (``slices`` by default), whose single Conv the NCHWc lowering
can then take.

``--previous`` adds a run of the CPU default as it was before the library's ``Permute`` (session
21): transposes on ORT's own ``Transpose`` (``mpgraph.kernels.permute.fast_transposes`` off), the
strided data gradient on ORT's ``ConvTranspose`` (``to_nchwc(phases=False)``) and the 3x3/1
weight gradient left as per-tap slices (``nchwc.slices_to_conv`` off).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step as gs  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def _mpgraph(trainer: Trainer, spec: gs.ModelSpec) -> Callable[[int], float]:
    data = next(s.name for s in trainer.data_inputs if s.name != "label")
    return lambda i: trainer.step({data: spec.inputs[i % len(spec.inputs)], "label": spec.labels[i % len(spec.labels)]}).loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-all", action="store_true", help="leave out the kernels=True run")
    p.add_argument("--dw-form", choices=["conv", "slices", "im2col"], help="also the default on this weight-gradient form")
    p.add_argument("--previous", action="store_true", help="also the default as it was before Permute (session 21)")
    args = p.parse_args()
    torch.set_num_threads(2)
    spec = gs.dqn_spec()
    graph = gs.step_graphs(spec, False, ["fp32"])["fp32"]
    trainers = {"off": Trainer(graph, "cpu", threads=2, kernels=False), "default": Trainer(graph, "cpu", threads=2)}
    if not args.no_all:
        trainers["all"] = Trainer(graph, "cpu", threads=2, kernels=True)
    if args.dw_form:
        from mpgraph.autodiff.rules.pool_conv import weight_grad_form

        with weight_grad_form(args.dw_form):
            formed = gs.step_graphs(spec, False, ["fp32"])["fp32"]
        trainers[f"dw {args.dw_form}"] = Trainer(formed, "cpu", threads=2)
    if args.previous:
        from unittest import mock

        import mpgraph.kernels as kernels_pkg

        plain_nchwc = kernels_pkg.to_nchwc
        with mock.patch("mpgraph.kernels.fast_transposes", lambda model: 0), \
                mock.patch("mpgraph.kernels.to_nchwc", lambda model, **kw: plain_nchwc(model)), \
                mock.patch("mpgraph.kernels.nchwc.slices_to_conv", lambda *a: 0):
            trainers["previous"] = Trainer(graph, "cpu", threads=2)
    steps: dict[str, Callable[[int], float]] = {k: _mpgraph(t, spec) for k, t in trainers.items()}
    steps["torch"] = gs.torch_run("torch", spec, "cpu").step
    times: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, float] = {}
    count = {k: 0 for k in steps}
    for r in range(args.rounds + 1):
        for k, step in steps.items():
            start = time.perf_counter()
            for _ in range(10):
                losses[k] = step(count[k])
                count[k] += 1
            if r:
                times[k].append((time.perf_counter() - start) / 10 * 1e3)
    med = {k: float(np.median(t)) for k, t in times.items()}
    for k, t in times.items():
        rewrites = f" ({trainers[k].kernels_fused} rewrites)" if k in trainers else ""
        print(f"{k:8s}{rewrites:16s} median {med[k]:6.2f} ms/step  min {min(t):6.2f}  rounds {', '.join(f'{x:.1f}' for x in t)}")
    for k in trainers:
        print(f"mpgraph {k} / torch: {med[k] / med['torch']:.3f}   (of minima {min(times[k]) / min(times['torch']):.3f})")
    print(f"default / off: {med['default'] / med['off']:.3f}")
    if "previous" in med:
        print(f"default / previous: {med['default'] / med['previous']:.3f}   (of minima {min(times['default']) / min(times['previous']):.3f})")
    print(f"loss after {count['torch']} steps: " + ", ".join(f"{k} {v:.6g}" for k, v in losses.items()))
    print("relative to torch: " + ", ".join(f"{k} {abs(losses[k] - losses['torch']) / abs(losses['torch']):.2e}" for k in trainers))


if __name__ == "__main__":
    main()
