"""The benchmark GPT's step as this tree builds it against a baseline tree, side by side on CUDA.

Builds the GPT of ``gpu_step.py`` (same seed, so the same weights and batches) and, for each
policy, the step graph as ``train-graph --target cuda`` makes it here and as the baseline
tree's mpgraph makes it (built in a subprocess with that tree first on ``sys.path``, saved,
and loaded here). Every graph goes through ``Trainer`` (CUDA graphs on); all are timed in
alternating rounds. It prints ms/step medians, the ratio, the loss after the last step of
each, and the kernel breakdown of each.

    git worktree add /tmp/base <commit>        # or: git archive <commit> mpgraph ... | tar -x
    python3 benchmarks/gpt_variant_ab.py --baseline-tree /tmp/base [--policies bf16,tf32] [--repeat]

``--kernels-ab`` instead times one graph of this tree with ``Trainer(kernels=False)`` (the
baseline) against ``kernels=True`` (mpgraph's fused kernels, ``mpgraph.lowering``), and checks
nothing else differs: no baseline tree is needed.

``--repeat`` runs the baseline graph a second time: how far two runs of one graph drift
apart on this provider (ORT CUDA's atomic adds, e.g. the embedding gradient's ScatterND
reduction, make the losses of two runs differ).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step  # noqa: E402
import onnx_ir as ir  # noqa: E402

#: Run in the baseline tree: build its step graphs and save them (argv: tree, out dir,
#: policies, small).
_BUILD = """
import os, sys
tree, out, policies, small = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4] == "1"
sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
import onnx_ir as ir
import gpu_step
import mpgraph
assert gpu_step.__file__.startswith(tree) and mpgraph.__file__.startswith(tree), (gpu_step.__file__, mpgraph.__file__)
graphs = gpu_step.step_graphs(gpu_step.gpt_spec(small), False, policies, target="cuda")
for policy, graph in graphs.items():
    ir.save(graph, os.path.join(out, policy + ".onnx"))
"""


def baseline_graphs(tree: str, policies: list[str], small: bool, out: str) -> dict[str, ir.Model]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "site" in p]
    if site:  # keep the staged onnxruntime-gpu, drop this tree
        env["PYTHONPATH"] = os.pathsep.join(site)
    subprocess.run([sys.executable, "-c", _BUILD, os.path.abspath(tree), out, ",".join(policies), "1" if small else "0"],
                   check=True, env=env)
    return {p: ir.load(os.path.join(out, p + ".onnx")) for p in policies}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-tree", help="a checkout of the baseline commit")
    p.add_argument("--kernels-ab", action="store_true", help="this tree's graph with kernels off (baseline) and on")
    p.add_argument("--policies", default="bf16,tf32")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--small", action="store_true", help="the small GPT (dry runs)")
    p.add_argument("--repeat", action="store_true", help="run the baseline graph twice (run-to-run drift)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="Trainer(cuda_graph=False): shapes stay symbolic, every node runs every step")
    args = p.parse_args()
    policies = args.policies.split(",")
    spec = gpu_step.gpt_spec(args.small)
    provider = "cuda" if gpu_step.torch.cuda.is_available() else "cpu"
    if not args.kernels_ab and not args.baseline_tree:
        p.error("give --baseline-tree or --kernels-ab")
    new = gpu_step.step_graphs(spec, False, policies, target="cuda")
    runs = []
    graph_flag = None if args.cuda_graph else False
    with tempfile.TemporaryDirectory() as tmp:
        old = new if args.kernels_ab else baseline_graphs(args.baseline_tree, policies, args.small, tmp)
        for policy in policies:
            if args.kernels_ab:
                pairs = [(f"{policy} kernels off", old[policy], False), (f"{policy} kernels on", new[policy], True)]
            else:
                pairs = [(f"{policy} baseline", old[policy], None), (f"{policy} this tree", new[policy], None)]
            if args.repeat:
                pairs.append((f"{pairs[0][0]} (again)", old[policy], pairs[0][2]))
            for label, graph, fused in pairs:
                kw = {} if fused is None else {"kernels": fused}
                runs.append(gpu_step.mpgraph_run(label, graph, spec, provider, None, cuda_graph=graph_flag, **kw))
                if fused:
                    print(f"{label}: {runs[-1].trainer.kernels_fused} nodes fused", flush=True)
    for r in range(args.rounds + 1):
        for run in runs:
            gpu_step.time_round(run, args.steps_per_round)
        print(f"round {r} done", flush=True)
    print(f"{'config':<28}{'ms/step':>9}  spread         loss@{len(runs[0].losses)}")
    for run in runs:
        ms = run.round_ms[1:]
        print(f"{run.label:<28}{statistics.median(ms):>9.3f}  {min(ms):.3f}-{max(ms):.3f}  {run.losses[-1]:.8f}"
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
