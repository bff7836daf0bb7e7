"""Where a step graph's GPU time goes, per ONNX node: ORT's own profiler, grouped by role and op.

``gpu_step.py`` classifies CUDA kernels by name; this script answers the next question, which
nodes of the step graph those kernels belong to. It builds the benchmark GPT (or a small one)
with ``gpu_step.py``'s builders, converts it per ``--policy``, runs ``--steps`` steps through the
``Trainer`` with ORT profiling on (no CUDA graph, so every node is seen), and prints kernel time
per step grouped by ``(mpgraph.role, op_type)``, by output dtype, and the top nodes.

    python3 benchmarks/profile_step.py --policy bf16 --out DIR          # the H200 GPT
    python3 benchmarks/profile_step.py --policy fp32 --small --provider cpu   # a dry run
    python3 benchmarks/profile_step.py --model dqn --policy fp32 --provider cpu --threads 2 --steps 20   # the DQN on CPU

Times are ORT's per-node ``kernel_time``, averaged over the profiled steps after a warm-up.
On CPU that is the node's run time. On CUDA it is only the host side of the launch (the
kernels run asynchronously: on the H200 GPT every node read about 0.05 ms whatever its size),
so it ranks nothing there; use ``--kernels``, which times the CUDA kernels themselves (CUPTI
through torch.profiler), by kernel name.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
from typing import Any

import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gpu_step  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def profiled_trainer(graph: Any, provider: str, prefix: str, threads: int | None = None) -> Trainer:
    """A Trainer whose sessions profile (ORT's SessionOptions patched for this process)."""
    base = ort.SessionOptions

    class Profiling(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    ort.SessionOptions = Profiling  # type: ignore[misc]
    try:
        return Trainer(graph, provider, cuda_graph=False, threads=threads)
    finally:
        ort.SessionOptions = base  # type: ignore[misc]


def node_info(graph: Any) -> dict[str, tuple[str, str]]:
    """``{node name: (role, op_type)}``."""
    return {n.name: (n.metadata_props.get("mpgraph.role", "-"), n.op_type) for n in graph.graph}


def summarize(events: list[dict[str, Any]], info: dict[str, tuple[str, str]], steps: int, top: int) -> dict[str, Any]:
    by_role_op: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_role: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_dtype: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    per_node: dict[str, float] = collections.defaultdict(float)
    shapes: dict[str, str] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        node = e["name"][: -len("_kernel_time")]
        role, op = info.get(node, ("?", e.get("args", {}).get("op_name", "?")))
        us = float(e.get("dur", 0))
        outs = e.get("args", {}).get("output_type_shape", [])
        dtype = next(iter(outs[0]), "?") if outs else "?"
        for key, table in (((role, op), by_role_op), (role, by_role), (dtype, by_dtype)):
            table[key][0] += 1  # type: ignore[index]
            table[key][1] += us  # type: ignore[index]
        per_node[node] += us
        shapes[node] = json.dumps(outs)[:120]

    def rows(table: dict[Any, list[float]]) -> list[dict[str, Any]]:
        out = [{"key": k if isinstance(k, str) else "/".join(k), "nodes": n / steps, "ms": us / steps / 1e3}
               for k, (n, us) in table.items()]
        return sorted(out, key=lambda r: -r["ms"])

    top_nodes = sorted(per_node.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": sum(per_node.values()) / steps / 1e3,
        "by_role": rows(by_role),
        "by_role_op": rows(by_role_op),
        "by_dtype": rows(by_dtype),
        "top_nodes": [{"node": n, "role": info.get(n, ("?", "?"))[0], "op": info.get(n, ("?", "?"))[1],
                       "ms": us / steps / 1e3, "outputs": shapes[n]} for n, us in top_nodes],
    }


def print_summary(policy: str, s: dict[str, Any]) -> None:
    print(f"== {policy}: node kernel time {s['total_ms']:.2f} ms/step ==")
    for title, key, limit in (("by role", "by_role", 20), ("by role/op", "by_role_op", 40), ("by output dtype", "by_dtype", 10)):
        print(f"-- {title}")
        for r in s[key][:limit]:
            print(f"  {r['key']:40s} {r['nodes']:7.0f} nodes {r['ms']:8.3f} ms")
    print("-- top nodes")
    for r in s["top_nodes"]:
        print(f"  {r['ms']:7.3f} ms  {r['role']:10s} {r['op']:20s} {r['node'][:70]}  {r['outputs']}")


def kernel_names(args: argparse.Namespace) -> None:
    """Top CUDA kernels by GPU time per step, by name, for each policy."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    spec = gpu_step.dqn_spec() if args.model == "dqn" else gpu_step.gpt_spec(args.small)
    policies = args.policy.split(",")
    graphs = gpu_step.step_graphs(spec, args.flat, policies, target="cuda" if args.provider == "cuda" else None)
    batches = len(spec.inputs)
    report = {}
    for policy in policies:
        trainer = Trainer(graphs[policy], args.provider, cuda_graph=False)
        data = next(s.name for s in trainer.data_inputs if s.name != "label")
        for i in range(3):
            trainer.step({data: spec.inputs[i % batches], "label": spec.labels[i % batches]})
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps):
                trainer.step({data: spec.inputs[i % batches], "label": spec.labels[i % batches]})
            torch.cuda.synchronize()
        table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            table[event.name[:150]][0] += 1
            table[event.name[:150]][1] += us
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])
        total = sum(us for _, (_, us) in rows) / args.steps / 1e3
        print(f"== {policy}: {sum(n for _, (n, _) in rows) / args.steps:.0f} kernels, {total:.2f} ms GPU per step ==")
        for name, (n, us) in rows[: args.top]:
            print(f"  {us / args.steps / 1e3:7.3f} ms {n / args.steps:6.0f}x  {name}")
        report[policy] = [{"name": k, "per_step": n / args.steps, "ms": us / args.steps / 1e3} for k, (n, us) in rows]
    with open(os.path.join(args.out, "kernel_names.json"), "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--policy", default="bf16", help="comma-separated: fp32,tf32,bf16,fp16")
    ap.add_argument("--provider", default="cuda")
    ap.add_argument("--model", choices=["gpt", "dqn"], default="gpt", help="gpu_step.py's GPT or Nature DQN (b32)")
    ap.add_argument("--small", action="store_true", help="the small GPT")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, help="ORT intra-op threads (default: ORT's; gpu_step.py's CPU rows use 2)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--flat", action="store_true")
    ap.add_argument("--kernels", action="store_true",
                    help="instead: CUDA kernels by name (CUPTI via torch.profiler), time per step, no CUDA graph")
    args = ap.parse_args()
    if args.kernels:
        return kernel_names(args)
    spec = gpu_step.dqn_spec() if args.model == "dqn" else gpu_step.gpt_spec(args.small)
    policies = args.policy.split(",")
    graphs = gpu_step.step_graphs(spec, args.flat, policies, target="cuda" if args.provider == "cuda" else None)
    batches = len(spec.inputs)
    report = {}
    for policy in policies:
        prefix = os.path.join(args.out, f"ort_profile_{policy}")
        trainer = profiled_trainer(graphs[policy], args.provider, prefix, args.threads)
        names = [s.name for s in trainer.data_inputs]
        data = next(n for n in names if n != "label")
        feed = lambda i, data=data: {data: spec.inputs[i % batches], "label": spec.labels[i % batches]}  # noqa: E731
        for i in range(2):  # warm-up: not separable in the profile, so subtracted below
            trainer.step(feed(i))
        path = trainer.session.end_profiling()
        warm = json.load(open(path))
        trainer = profiled_trainer(graphs[policy], args.provider, prefix, args.threads)
        for i in range(2 + args.steps):
            trainer.step(feed(i))
        path = trainer.session.end_profiling()
        events = json.load(open(path))
        # Same trainer setup twice: the second profile minus the first's events is the
        # steady-state steps (session creation and first-run allocations cancel).
        warm_nodes = collections.Counter(e["name"] for e in warm if e.get("cat") == "Node")
        steady = []
        for e in events:
            if e.get("cat") == "Node" and warm_nodes[e["name"]] > 0:
                warm_nodes[e["name"]] -= 1
                continue
            steady.append(e)
        s = summarize(steady, node_info(graphs[policy]), args.steps, args.top)
        print_summary(policy, s)
        report[policy] = s
        for f in glob.glob(prefix + "*.json"):
            os.remove(f)
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
