"""ORT's memory pattern on and off for the benchmark GPT's CUDA step, as the Trainer runs it.

The GPT of ``gpu_step.py`` (same seed, weights and batches), CUDA graphs and fused kernels on,
``Trainer(mem_pattern=True)`` (ORT's default) against ``mem_pattern=False``:

- **memory**: each setting in its own child process (ORT keeps allocators per process): device
  memory in use (``cudaMemGetInfo`` through torch) after ``--steps`` steps, minus before the
  Trainer existed;
- **speed**: both Trainers alive in one process, timed in alternating rounds; ms/step medians
  and the ratio;
- **loss**: the loss after the last timed step of each (the same graph: it should agree).

    python3 benchmarks/mem_pattern_ab.py [--policies bf16,fp16] [--rounds 5] [--steps-per-round 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step  # noqa: E402
import onnx_ir as ir  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def make(path: str, pattern: bool, spec: gpu_step.ModelSpec) -> tuple[Trainer, object]:
    trainer = Trainer(ir.load(path), "cuda", mem_pattern=pattern)
    names = [s.name for s in trainer.data_inputs]
    data = next(n for n in names if n != "label")

    def step(i: int) -> float:
        k = i % len(spec.inputs)
        return trainer.step({data: spec.inputs[k], "label": spec.labels[k]}).loss

    return trainer, step


def child(path: str, pattern: bool, steps: int) -> None:
    spec = gpu_step.gpt_spec(small=False)
    before = gpu_step.device_used_mib()
    trainer, step = make(path, pattern, spec)
    loss = [step(i) for i in range(steps)][-1]
    print(json.dumps({"mib": gpu_step.device_used_mib() - before, "loss": loss, "cuda_graph": trainer.cuda_graph,
                      "kernels_fused": trainer.kernels_fused}))


def memory(path: str, pattern: bool, steps: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", path, "--pattern", "on" if pattern else "off",
                           "--steps", str(steps)], capture_output=True, text=True, timeout=900)
    line = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not line:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(line[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="bf16,fp16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="steps before a child reads the device memory")
    p.add_argument("--child")
    p.add_argument("--pattern", choices=("on", "off"))
    args = p.parse_args()
    if args.child:
        child(args.child, args.pattern == "on", args.steps)
        return
    policies = args.policies.split(",")
    spec = gpu_step.gpt_spec(small=False)
    graphs = gpu_step.step_graphs(spec, flat=False, policies=policies, target="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for policy, graph in graphs.items():
            paths[policy] = os.path.join(tmp, f"gpt.{policy}.onnx")
            ir.save(graph, paths[policy])
        del graphs
        for policy in policies:
            mem = {pattern: memory(paths[policy], pattern, args.steps) for pattern in (True, False)}
            runs = {pattern: make(paths[policy], pattern, spec) for pattern in (True, False)}
            times: dict[bool, list[float]] = {True: [], False: []}
            losses = {}
            for r in range(args.rounds + 1):
                for pattern, (_, step) in runs.items():
                    start = time.perf_counter()
                    for i in range(args.steps_per_round):
                        losses[pattern] = step(r * args.steps_per_round + i)
                    if r:
                        times[pattern].append((time.perf_counter() - start) / args.steps_per_round * 1e3)
            for pattern in (True, False):
                m = mem[pattern]
                print(f"{policy} memory pattern {'on ' if pattern else 'off'}: {m['mib']:8.0f} MiB after {args.steps} steps "
                      f"(own process; cuda graph {m['cuda_graph']}, {m['kernels_fused']} kernel rewrites), "
                      f"{statistics.median(times[pattern]):7.3f} ms/step (rounds {min(times[pattern]):.3f}-"
                      f"{max(times[pattern]):.3f}), loss {losses[pattern]:.8f}")
            print(f"{policy} off / on: memory {mem[False]['mib'] / mem[True]['mib']:.3f}, time "
                  f"{statistics.median(times[False]) / statistics.median(times[True]):.3f}")
            del runs


if __name__ == "__main__":
    main()
