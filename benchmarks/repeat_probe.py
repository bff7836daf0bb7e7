"""Is mpgraph's CUDA step deterministic? Two trainers from the same graph, state and batches,
run side by side, then a pipelined one: the losses of every step compared bit for bit.

``gpu_step.py``'s GPT rows end 50 steps a little apart between the synchronous and the
pipelined bf16 trainer (1.21921 against 1.22052 in ``gpu_step_2026-12-01T17.log``), although the
pipelined path gives ``step``'s bits on the tiny MLP (``tests/test_step_many.py``). This probe
says whether two *synchronous* trainers already differ (run-to-run nondeterminism in the
kernels: atomics, cuBLAS/cuDNN algorithm choice per session) or only the pipelined one does,
and whether ``Trainer(deterministic=True)`` (ORT's ``use_deterministic_compute``) removes it.

    python3 benchmarks/repeat_probe.py --models gpt,dqn_cnn --policies bf16,fp32 --steps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_step import dqn_spec, gpt_spec, step_graphs, tiny_spec  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def losses(trainer: Trainer, spec, steps: int) -> list[float]:
    names = [s.name for s in trainer.data_inputs]
    data_name = next(n for n in names if n != "label")
    batches = [{data_name: spec.inputs[i % len(spec.inputs)], "label": spec.labels[i % len(spec.inputs)]}
               for i in range(steps)]
    if trainer.pipeline:
        return [r.loss for r in trainer.step_many(batches)]
    return [trainer.step(b).loss for b in batches]


def first_difference(a: list[float], b: list[float]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first differs at step {i + 1} ({x!r} vs {y!r}); at the end {a[-1]:.6f} vs {b[-1]:.6f} ({abs(a[-1] - b[-1]) / abs(b[-1]):.2e} rel)"
    return f"identical over {len(a)} steps (last {a[-1]!r})"


def state_diff(graph, spec, label: str, kw: dict, steps: int = 3) -> None:
    """Two trainers, one batch a step: which state tensors differ after each step."""
    a, b = Trainer(graph, "cuda", **kw), Trainer(graph, "cuda", **kw)
    names = [s.name for s in a.data_inputs]
    data_name = next(n for n in names if n != "label")
    for i in range(steps):
        batch = {data_name: spec.inputs[i % len(spec.inputs)], "label": spec.labels[i % len(spec.inputs)]}
        la, lb = a.step(batch).loss, b.step(batch).loss
        sa, sb = a.state, b.state
        diff = [k for k in sa if sa[k].tobytes() != sb[k].tobytes()]
        print(f"{label} step {i + 1}: loss {'equal' if la == lb else f'{la!r} vs {lb!r}'}; "
              f"{len(diff)} of {len(sa)} state tensors differ: {', '.join(diff[:8])}")
    timed = 20
    start = time.perf_counter()
    for i in range(timed):
        a.step({data_name: spec.inputs[i % len(spec.inputs)], "label": spec.labels[i % len(spec.inputs)]})
    print(f"{label}: {(time.perf_counter() - start) * 1e3 / timed:.3f} ms/step (synchronous step, {timed} steps)")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,dqn_cnn")
    p.add_argument("--policies", default="bf16,fp32")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--small", action="store_true")
    p.add_argument("--state-diff", action="store_true",
                   help="which state tensors two trainers leave different, step by step, per configuration")
    args = p.parse_args()
    makers = {"gpt": lambda: gpt_spec(args.small), "tiny_mlp": tiny_spec, "dqn_cnn": dqn_spec}
    for model in args.models.split(","):
        spec = makers[model]()
        graphs = step_graphs(spec, False, args.policies.split(","), target="cuda")
        for policy, graph in graphs.items():
            if args.state_diff:
                for label, kw in [("default", {}), ("deterministic", {"deterministic": True}),
                                  ("deterministic, conv search EXHAUSTIVE",
                                   {"deterministic": True, "provider_options": {"cudnn_conv_algo_search": "EXHAUSTIVE"}})]:
                    state_diff(graph, spec, f"{model} {policy} {label}", {"pipeline": False, **kw})
                continue
            kinds = {"sync A": {"pipeline": False}, "sync B": {"pipeline": False}, "pipelined": {"pipeline": True},
                     "deterministic A": {"pipeline": False, "deterministic": True},
                     "deterministic B": {"pipeline": False, "deterministic": True}}
            got, seconds = {}, {}
            for name, kw in kinds.items():
                trainer = Trainer(graph, "cuda", **kw)
                start = time.perf_counter()
                got[name] = losses(trainer, spec, args.steps)
                seconds[name] = time.perf_counter() - start
                del trainer
            for a, b in [("sync A", "sync B"), ("pipelined", "sync A"), ("deterministic A", "deterministic B"),
                         ("deterministic A", "sync A")]:
                print(f"{model} {policy}: {a} vs {b}: {first_difference(got[a], got[b])}")
            print(f"{model} {policy}: seconds for {args.steps} steps (capture included): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
