"""A pipelined trainer's batch upload: pinned memory and an asynchronous copy on the trainer's
stream (the default) against ``OrtValue.update_inplace`` (synchronous, from pageable memory),
side by side in one process.

For each model (``gpu_step.py``'s tiny MLP and Nature DQN, built with ``target="cuda"``), three
trainers start from the same step graph: ``Trainer(pipeline=False)`` (the reference),
``Trainer(pipeline=True)`` with the asynchronous upload, and the same with it switched off.
All three run the same batches; the script checks that both pipelined trainers give the
reference's losses and final state bit for bit (a copy that raced a step still reading its
buffer would show as a mismatch), then times ``step_many`` in alternating rounds (median
microseconds a step; ``step_many`` ends by waiting for its last step's event, so the GPU's work
is inside the time).

    python3 benchmarks/upload_ab.py [--steps 200] [--rounds 7] [--models tiny_mlp,dqn_cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def trainers(graph: object) -> dict[str, Trainer]:
    out = {"reference": Trainer(graph, "cuda", pipeline=False),
           "async upload": Trainer(graph, "cuda", pipeline=True),
           "update_inplace": Trainer(graph, "cuda", pipeline=True)}
    out["update_inplace"]._async_upload = False  # noqa: SLF001 - the switch this A/B exists for
    return out


def check(runs: dict[str, Trainer], batches: list[dict[str, np.ndarray]], steps: int) -> list[str]:
    """Run ``steps`` steps on every trainer; lines saying whether each equals the reference."""
    order = [batches[i % len(batches)] for i in range(steps)]
    ref = runs["reference"]
    ref_losses = [ref.step(b).loss for b in order]
    ref_state = ref.state
    lines = []
    for name in ("async upload", "update_inplace"):
        t = runs[name]
        losses = [r.loss for r in t.step_many(order)]
        state = t.state
        same_state = all(np.array_equal(ref_state[k], state[k]) for k in ref_state)
        uploads = t._replay is not None and t._replay.uploads is not None  # noqa: SLF001
        lines.append(f"  {name:<15} pipelined={t.pipeline} async uploads in use={uploads}: "
                     f"losses equal the reference's {losses == ref_losses}, final state {same_state}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--models", default="tiny_mlp,dqn_cnn")
    args = p.parse_args()
    specs = {"tiny_mlp": gpu_step.tiny_spec, "dqn_cnn": gpu_step.dqn_spec}
    for model in args.models.split(","):
        spec = specs[model]()
        graph = gpu_step.step_graphs(spec, False, ["fp32"], target="cuda")["fp32"]
        runs = trainers(graph)
        data_name = next(s.name for s in runs["reference"].data_inputs if s.name != "label")
        batches = [{data_name: spec.inputs[i], "label": spec.labels[i]} for i in range(len(spec.inputs))]
        print(f"== {model} (batch {spec.batch}), {args.steps} steps ==")
        for line in check(runs, batches, args.steps):
            print(line)
        order = [batches[i % len(batches)] for i in range(args.steps)]
        timings: dict[str, list[float]] = {"async upload": [], "update_inplace": []}
        for r in range(args.rounds):
            for name in (timings if r % 2 == 0 else reversed(list(timings))):
                start = time.perf_counter()
                runs[name].step_many(order)
                timings[name].append((time.perf_counter() - start) * 1e6 / args.steps)
        print(f"{'upload':<16}{'us/step (median)':>18}{'min':>9}{'max':>9}")
        for name, values in timings.items():
            print(f"{name:<16}{statistics.median(values):>18.1f}{min(values):>9.1f}{max(values):>9.1f}")
        ratio = statistics.median(timings["async upload"]) / statistics.median(timings["update_inplace"])
        print(f"  async upload / update_inplace: {ratio:.3f}\n")


if __name__ == "__main__":
    main()
