"""``audit --memory``'s estimate next to the device memory ORT CUDA really takes for one step.

For the zoo GPT (``models/onnx/gpt.loss.onnx``) and the benchmark GPT of ``gpu_step.py`` (d1024,
8 layers, T512, vocab 8192, batch 8), AdamW, policies fp32 and bf16, it prints the estimated
peak (``mpgraph.audit.memory.estimate_memory``) and the measured one: the device memory in use
after a few steps minus before the session was made (``cudaMemGetInfo`` through torch), with
ORT's arena told to grow by exactly what is requested (``arena_extend_strategy=kSameAsRequested``)
so that the arena's size is its peak rather than the next power of two, and without CUDA graphs
(``--cuda-graph`` measures with them). The measured number also
holds cuBLAS/cuDNN workspaces and handles, which the estimate does not model.

Run on a GPU machine (onnxruntime-gpu, torch with CUDA)::

    python benchmarks/memory_check.py                 # both GPTs, fp32 and bf16
    python benchmarks/memory_check.py --estimate-only # the estimates alone (any machine)
    python benchmarks/memory_check.py --cpu --models zoo_gpt --policies fp32 --zoo-batch 1024
                                                      # float32 on ORT CPU: peak RSS of a fresh process

Output: one line per (model, policy): estimate, measured, and the error (estimate / measured - 1).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mpgraph  # noqa: E402
from mpgraph.audit.memory import estimate_memory  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402


def zoo_gpt(batch: int) -> tuple[ir.Model, dict[str, np.ndarray]]:
    from models.zoo import GPT_SEQ, GPT_VOCAB

    step = build_training_graph("models/onnx/gpt.loss.onnx", optimizer="adamw", optimizer_options={"weight_decay": 0.01})
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, GPT_VOCAB, (batch, GPT_SEQ), dtype=np.int64),
             "label": rng.integers(0, GPT_VOCAB, (batch, GPT_SEQ), dtype=np.int64)}
    return step, feeds


def bench_gpt(batch: int) -> tuple[ir.Model, dict[str, np.ndarray]]:
    import torch

    from models.zoo import GPT
    from mpgraph.export import export_module

    vocab, seq, d, heads, layers = 8192, 512, 1024, 16, 8
    torch.manual_seed(0)
    module = GPT(vocab=vocab, seq=seq, d_model=d, heads=heads, layers=layers).train()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    proto = export_module(copy.deepcopy(module), torch.from_numpy(tokens[:2]), loss="cross_entropy")
    step = build_training_graph(proto, optimizer="adamw", lr=3e-4, optimizer_options={"weight_decay": 0.01})
    names = [v.name for v in step.graph.inputs if v.dtype == ir.DataType.INT64]
    data = next(n for n in names if n != "label")
    return step, {data: tokens, "label": rng.integers(0, vocab, (batch, seq), dtype=np.int64)}


def device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def measure(step: ir.Model, feeds: dict[str, np.ndarray], steps: int, cuda_graph: bool) -> int:
    """Device bytes a CUDA Trainer for ``step`` holds after ``steps`` steps."""
    import torch

    from mpgraph.runtime.trainer import Trainer

    torch.cuda.init()
    gc.collect()
    before = device_used()
    trainer = Trainer(step, "cuda", provider_options={"arena_extend_strategy": "kSameAsRequested"}, cuda_graph=cuda_graph)
    for _ in range(steps):
        trainer.step(feeds)
    torch.cuda.synchronize()
    used = device_used() - before
    del trainer
    gc.collect()
    return used


_CPU_CHILD = r"""
import ctypes, resource, sys, numpy as np, onnxruntime as ort
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
model = open(sys.argv[1], "rb").read()
feeds = dict(np.load(sys.argv[2]))
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.enable_cpu_mem_arena = sys.argv[3] == "arena"
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
# Session creation has its own transient peak: give freed memory back, reset the high-water mark
# (clear_refs 5, Linux >= 4.0), and measure what the steps add on top of the loaded session.
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
for _ in range(2):
    session.run(None, feeds)
print(status("VmHWM") - before)
"""


def measure_cpu(step: ir.Model, feeds: dict[str, np.ndarray], arena: bool) -> int:
    """Peak resident bytes two steps add to a loaded ORT CPU session for ``step`` (fresh process):
    the run's share of the estimate is outputs + transient peak (the weights are loaded before)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model, data = Path(tmp) / "step.onnx", Path(tmp) / "feeds.npz"
        model.write_bytes(ir.to_proto(step).SerializeToString())
        np.savez(data, **feeds)
        # A fixed mmap threshold: glibc otherwise raises it as buffers are freed and serves later
        # large buffers from the heap, where freed memory stays resident (noisy, 30% swings).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run([sys.executable, "-c", _CPU_CHILD, str(model), str(data), "arena" if arena else "no-arena"],
                             capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="zoo_gpt,bench_gpt")
    parser.add_argument("--policies", default="fp32,bf16")
    parser.add_argument("--zoo-batch", type=int, default=256)
    parser.add_argument("--bench-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="Measure with the Trainer's CUDA graphs (off by default: the capture's pools are not the step's).")
    parser.add_argument("--cpu", action="store_true",
                        help="Measure float32 on ORT CPU instead (peak RSS of a fresh process; the same allocation "
                             "planner as CUDA): a check of the liveness model on a machine without a GPU.")
    parser.add_argument("--cpu-arena", action="store_true", help="With --cpu: keep ORT's CPU arena (off by default).")
    parser.add_argument("--estimate-only", action="store_true", help="Print the estimates; run nothing on a GPU.")
    args = parser.parse_args()
    makers = {"zoo_gpt": (zoo_gpt, args.zoo_batch), "bench_gpt": (bench_gpt, args.bench_batch)}
    what = "outputs + transient peak, vs the RSS two steps add" if args.cpu else "persistent + outputs + transient peak"
    print(f"{'model':10s} {'policy':6s} {'batch':>5s} {'params':>11s} {'estimate MiB':>13s} {'measured MiB':>13s} "
          f"{'error':>7s}  (estimate: {what})")
    for name in args.models.split(","):
        make, batch = makers[name]
        step, feeds = make(batch)
        for policy in args.policies.split(","):
            fresh = ir.from_proto(ir.to_proto(step))
            graph = fresh if policy == "fp32" else mpgraph.convert(fresh, policy, validate=False)
            report = estimate_memory(graph, batch=batch)
            estimate = report.estimated_peak_bytes / 2**20
            measured = error = ""
            if args.cpu and policy != "fp32":
                pass  # ORT CPU runs no bf16 and computes fp16 in float32: only float32 is comparable
            elif args.cpu:
                got = measure_cpu(graph, feeds, args.cpu_arena) / 2**20
                run_estimate = (report.output_bytes + report.transient_peak_bytes) / 2**20
                measured, error = f"{got:13.1f}", f"{run_estimate / got - 1:+7.1%}"
                estimate = run_estimate
            elif not args.estimate_only:
                got = measure(graph, feeds, args.steps, args.cuda_graph) / 2**20
                measured, error = f"{got:13.1f}", f"{estimate / got - 1:+7.1%}"
            print(f"{name:10s} {policy:6s} {batch:5d} {report.parameters:11,d} {estimate:13.1f} {measured:>13s} {error:>7s}"
                  f"  (persistent {report.persistent_bytes / 2**20:.1f}, outputs {report.output_bytes / 2**20:.1f}, "
                  f"transient {report.transient_peak_bytes / 2**20:.1f}, saved for backward "
                  f"{report.saved_for_backward_bytes / 2**20:.1f})", flush=True)


if __name__ == "__main__":
    main()
