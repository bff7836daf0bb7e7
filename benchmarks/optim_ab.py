"""Flat optimizer A/B: step time of per-tensor, packed (today's default) and flat optimizer steps.

For each model it builds three AdamW step graphs from the same forward model, differing only in
``optimizer_options``: ``pack=False`` (every parameter updated on its own), the default (small
parameters packed, large ones on their own) and ``flat=True`` (every float32 parameter in one
flat buffer). Optionally converts them with one policy (``--policy bf16``; fp16 adds dynamic
loss scaling, which the flat form unscales, checks and skips once). Each graph gets a
``Trainer`` and the same batches; the graphs are timed in alternating rounds in one process, so
the ratios come from one run. Prints ms/step (median and spread over rounds), the ratio to
per-tensor, and the node counts (all nodes, optimizer-role nodes, loss-scaling Where/ReduceSum).

    python3 benchmarks/optim_ab.py --provider cpu --threads 2              # zoo gpt and wide_mlp
    python3 benchmarks/optim_ab.py --provider cpu --threads 1 --clock cpu  # the same, on a busy CPU
    python3 benchmarks/optim_ab.py --provider cuda --models gpt-h200 --policy bf16 --variants packed,flat,flat-grouped
    python3 benchmarks/optim_ab.py --provider cuda --models gpt-h200 --policy fp16

``gpt-h200`` is issue 11's GPT (vocab 8192, d 1024, 16 heads, 8 layers, T 512, batch 8; 118M
parameters), exported from ``models.zoo.GPT`` here (needs torch; the step graph is about 1.4 GB
in memory). On the GPU machine ORT must be onnxruntime-gpu.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import onnx_ir as ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mpgraph  # noqa: E402
from mpgraph._ir import meta as md  # noqa: E402
from mpgraph.optim import base as optim_base  # noqa: E402
from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VARIANTS = {"per-tensor": {"pack": False}, "packed": {}, "flat": {"flat": True}, "flat-grouped": {"flat": True}}


def forward_model(name: str) -> tuple[Any, dict[str, tuple[int, ...]], int]:
    """``(forward model with loss, data input shapes without batch, classes)``."""
    if name in ("gpt-h200", "gpt-dry"):
        import torch

        from models.zoo import GPT
        from mpgraph.export import export_module

        # gpt-dry: the same 101 parameter tensors at d_model 64, for a dry run of the script.
        vocab, seq, d, heads = (8192, 512, 1024, 16) if name == "gpt-h200" else (256, 64, 64, 4)
        torch.manual_seed(0)
        module = GPT(vocab=vocab, seq=seq, d_model=d, heads=heads, layers=8).train()
        example = torch.randint(0, vocab, (2, seq))
        return export_module(module, example, loss="cross_entropy"), {"tokens": (seq,), "label": (seq,)}, vocab
    path = os.path.join(ROOT, "models", "onnx", f"{name}.loss.onnx")
    if name == "gpt":
        return path, {"tokens": (16,), "label": (16,)}, 64
    return path, {}, 10 if name == "wide_mlp" else 2


def batches(trainer: Trainer, shapes: dict[str, tuple[int, ...]], batch: int, classes: int, count: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        feeds = {}
        for spec in trainer.data_inputs:
            dims = (batch, *shapes[spec.name]) if spec.name in shapes else \
                tuple(batch if not isinstance(d, int) else d for d in (spec.shape or [batch]))
            if spec.dtype.kind in "iu":
                feeds[spec.name] = rng.integers(0, classes, dims).astype(spec.dtype)
            else:
                feeds[spec.name] = rng.standard_normal(dims).astype(spec.dtype)
        out.append(feeds)
    return out


def node_counts(model: ir.Model) -> str:
    roles = collections.Counter(n.metadata_props.get(md.NODE_ROLE) for n in model.graph)
    ops = collections.Counter(n.op_type for n in model.graph if n.metadata_props.get(md.NODE_ROLE) == "optimizer")
    return (f"{len(model.graph):5d} nodes, optimizer {roles['optimizer']:4d} "
            f"(Reshape {ops['Reshape']}, Where {ops['Where']}, ReduceSum {ops['ReduceSum']})")


def run_model(name: str, args: argparse.Namespace) -> None:
    source, shapes, classes = forward_model(name)
    trainers: dict[str, Trainer] = {}
    for label in args.variants.split(","):
        options = VARIANTS[label]
        # flat-grouped: the flat buffer split back per group of equal trailing dims.
        default_unpack, optim_base.FLAT_UNPACK = optim_base.FLAT_UNPACK, "grouped" if label == "flat-grouped" else "reshape"
        try:
            step = build_training_graph(source, optimizer="adamw", lr=1e-4,
                                        optimizer_options={"weight_decay": 0.01, **options})
        finally:
            optim_base.FLAT_UNPACK = default_unpack
        if args.policy != "fp32":
            step = mpgraph.convert(step, args.policy, emulate=args.provider == "cpu" and args.policy != "fp32")
        print(f"{name:10s} {label:10s} {node_counts(step)}", flush=True)
        kw: dict[str, Any] = {"threads": args.threads} if args.provider == "cpu" else {}
        trainers[label] = Trainer(step, provider=args.provider, **kw)
    batch = args.batch or (8 if name.startswith("gpt-") else 64)
    data = batches(next(iter(trainers.values())), shapes, batch, classes)
    for trainer in trainers.values():  # warm-up: allocations, CUDA graph capture, thread pools
        for i in range(args.warmup):
            trainer.step(data[i % len(data)])
    times: dict[str, list[float]] = {label: [] for label in trainers}
    # Process CPU time is steadier than wall time on a shared CPU; with one thread (ORT does
    # not spin then) it is the work done. Wall time is what the GPU run wants.
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    order = list(trainers)
    for r in range(args.rounds):
        # Alternate the order so neither variant always follows the other.
        for label in order if r % 2 == 0 else order[::-1]:
            trainer = trainers[label]
            start = clock()
            for i in range(args.steps):
                trainer.step(data[i % len(data)])
            times[label].append(1000 * (clock() - start) / args.steps)
    # On a shared machine the minimum over rounds is the steadier estimate; both are printed.
    first = order[0]
    base, base_min = statistics.median(times[first]), min(times[first])
    for label, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:10s} {label:10s} {median:9.3f} ms/step median, {min(samples):9.3f} min, {max(samples):9.3f} max; "
              f"x {first}: {median / base:.3f} (median), {min(samples) / base_min:.3f} (min)", flush=True)
    for a, b in (("flat", "packed"), ("flat", "per-tensor")):
        if a not in times or b not in times:
            continue
        print(f"{name:10s} {a} / {b} = {statistics.median(times[a]) / statistics.median(times[b]):.3f} (median), "
              f"{min(times[a]) / min(times[b]):.3f} (min)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,wide_mlp", help="comma list: zoo names (gpt, wide_mlp, tiny_mlp, ...), gpt-h200 or gpt-dry")
    parser.add_argument("--provider", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--policy", default="fp32", help="fp32 (no conversion), bf16, fp16, ... (emulated on cpu)")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads on cpu")
    parser.add_argument("--batch", type=int, default=None, help="default: 8 for gpt-h200, else 64")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default="per-tensor,packed,flat",
                        help="comma list of per-tensor (pack=False), packed (the default), flat, flat-grouped (FLAT_UNPACK='grouped'); the first is the base")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall time, or this process's CPU time (use with --threads 1 on a shared CPU)")
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variant {sorted(unknown)[0]}; choose from {', '.join(VARIANTS)}")
    print(f"provider {args.provider}, policy {args.policy}, threads {args.threads}, {args.clock} clock, "
          f"rounds {args.rounds} x {args.steps} steps")
    for name in args.models.split(","):
        run_model(name.strip(), args)


if __name__ == "__main__":
    main()
