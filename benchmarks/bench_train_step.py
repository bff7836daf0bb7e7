"""ORT CPU step time of mpgraph training graphs next to torch eager CPU, per zoo model.

Both sides run the same model, batch, loss and AdamW step on the same number of threads; the
ORT side is one ``CpuRunner.step`` (state stays in OrtValues), the torch side is
``zero_grad; forward; loss; backward; step``. The two are timed in alternating chunks (so
background load hits both alike); prints the median step time of each and the ratio
(target: ORT <= 1.5x torch).

Each side runs with its threads' default waiting policy (both spin between parallel regions),
and each chunk starts after a pause (``--gap``) and one untimed step, so that neither side's
spinning threads run into the other's chunk. The 2-vCPU development VM is shared: over one
session the ResNet's ORT step measured either about 37 or about 52 ms at 2 threads (torch
moved less), in runs minutes apart, so compare ratios from one run, and repeat it.

Run: ``.venv/bin/python benchmarks/bench_train_step.py [--threads 2] [--rounds 8] [--steps 5]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.zoo import ZOO  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402
from tests.cpu_runner import CpuRunner  # noqa: E402

BATCH = {"tiny_mlp": 64, "wide_mlp": 256, "dqn_cnn": 32, "gpt": 8, "resnet": 32}


def _loss(entry, logits, label):
    if entry.loss == "cross_entropy":
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), label.flatten())
    return torch.nn.functional.mse_loss(logits, label)


def _interleaved_ms(fns: list, rounds: int, steps: int, warmup: int, gap: float) -> list[float]:
    """Median ms/step of each function, timed in alternating chunks of ``steps`` so that load
    from other processes hits all of them alike; each chunk after ``gap`` seconds of rest and
    one untimed call, so no chunk shares the cores with the other side's spinning threads."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, samples, strict=True):
            time.sleep(gap)
            fn()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t0) / steps)
    return [1e3 * statistics.median(times) for times in samples]


def _bench(name: str, args: argparse.Namespace) -> tuple[str, int, int, float, float]:
    entry, batch = ZOO[name], BATCH[name]
    x, label = entry.example_input(batch), entry.example_label(batch)
    step = build_training_graph(ROOT / "models" / "onnx" / f"{name}.loss.onnx", optimizer="adamw", lr=1e-4)
    runner = CpuRunner(step, threads=args.threads)
    feeds = {"tokens" if entry.vocab else "x": x.numpy(), "label": label.numpy()}

    module = entry.build()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def torch_step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(entry, module(x), label).backward()
        opt.step()

    ort_ms, torch_ms = _interleaved_ms([lambda: runner.step(feeds), torch_step], args.rounds, args.steps, args.warmup, args.gap)
    return name, batch, len(step.graph), ort_ms, torch_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed chunk")
    parser.add_argument("--rounds", type=int, default=8, help="alternating ORT/torch chunks")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds of rest before each chunk")
    parser.add_argument("--models", default=",".join(ZOO))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [_bench(name, args) for name in args.models.split(",")]
    print(f"threads={args.threads}, {args.rounds} alternating chunks of {args.steps} steps (median ms/step, AdamW)")
    print(f"{'model':<10} {'batch':>5} {'nodes':>6} {'ort':>9} {'torch':>9} {'ratio':>6}")
    for name, batch, nodes, ort_ms, torch_ms in rows:
        print(f"{name:<10} {batch:>5} {nodes:>6} {ort_ms:>9.3f} {torch_ms:>9.3f} {ort_ms / torch_ms:>6.2f}")


if __name__ == "__main__":
    main()
