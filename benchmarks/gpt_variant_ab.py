"""The benchmark GPT's step with and without one build-time rewrite, timed side by side on CUDA.

Builds the GPT of ``gpu_step.py`` (same weights and batches), then for each policy the step
graph as ``train-graph --target cuda`` makes it, and the same graph with the named rewrite
switched off. Both go through ``Trainer`` (CUDA graphs on) and are timed in alternating rounds;
it prints ms/step medians, the ratio, the loss after the last step of each (they must agree
bit for bit when the rewrite keeps the values) and the kernel breakdown of each.

    python3 benchmarks/gpt_variant_ab.py --variant expand-where [--policies bf16,tf32]

Variants:
    expand-where: ``ExpandWhereConditionsPass`` (full-size ``Where`` conditions).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step  # noqa: E402
import onnx_ir as ir  # noqa: E402

from mpgraph.training import expand_conditions  # noqa: E402


@contextlib.contextmanager
def without_expand_where() -> Iterator[None]:
    original = expand_conditions.ExpandWhereConditionsPass.call
    expand_conditions.ExpandWhereConditionsPass.call = lambda self, model: ir.passes.PassResult(model, modified=False)
    try:
        yield
    finally:
        expand_conditions.ExpandWhereConditionsPass.call = original


VARIANTS = {"expand-where": without_expand_where}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    p.add_argument("--policies", default="bf16,tf32")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--small", action="store_true", help="the small GPT (dry runs)")
    p.add_argument("--repeat", action="store_true",
                   help="also run the graph without the rewrite a second time: how far two runs of one "
                        "graph drift apart on this provider (ORT CUDA's atomics, e.g. ScatterND's reduction)")
    args = p.parse_args()
    policies = args.policies.split(",")
    spec = gpu_step.gpt_spec(args.small)
    provider = "cuda" if gpu_step.torch.cuda.is_available() else "cpu"
    on = gpu_step.step_graphs(spec, False, policies, target="cuda")
    with VARIANTS[args.variant]():
        off = gpu_step.step_graphs(spec, False, policies, target="cuda")
    runs = []
    for policy in policies:
        pairs = [(f"{policy} without {args.variant}", off[policy]), (f"{policy} with {args.variant}", on[policy])]
        if args.repeat:
            pairs.append((f"{policy} without {args.variant} (again)", off[policy]))
        for label, graph in pairs:
            runs.append(gpu_step.mpgraph_run(label, graph, spec, provider, None))
    for r in range(args.rounds + 1):
        for run in runs:
            gpu_step.time_round(run, args.steps_per_round)
        print(f"round {r} done", flush=True)
    print(f"{'config':<36}{'ms/step':>9}  spread         loss@{len(runs[0].losses)}")
    for run in runs:
        ms = run.round_ms[1:]
        print(f"{run.label:<36}{statistics.median(ms):>9.3f}  {min(ms):.3f}-{max(ms):.3f}  {run.losses[-1]:.8f}"
              f"  {'cuda graph' if run.trainer is not None and run.trainer.cuda_graph else ''}{run.error}")
    per = 3 if args.repeat else 2
    for i in range(0, len(runs), per):
        a, b = runs[i], runs[i + 1]
        print(f"{b.label} / {a.label}: {statistics.median(b.round_ms[1:]) / statistics.median(a.round_ms[1:]):.3f}")
    if provider == "cuda":
        for run in runs:
            k = gpu_step.kernel_breakdown(run)
            classes = ", ".join(f"{c} {v['kernels']:.0f}/{v['ms']:.2f}ms" for c, v in k["by_class"].items())
            print(f"  kernels {run.label}: {k['kernels_per_step']:.0f} per step, GPU {k['gpu_ms_per_step']:.2f} ms  [{classes}]")


if __name__ == "__main__":
    main()
