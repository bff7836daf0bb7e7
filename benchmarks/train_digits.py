"""Mixed-precision training matches fp32 on CPU (emulated): scikit-learn's digits, MLP and CNN.

Each model is exported once (``export_module``, cross-entropy loss, fixed torch seed), turned
into an AdamW step graph, and trained three ways on ORT's CPU provider with the same initial
weights, data order, learning rate and step count:

- ``fp32``: the step graph as built;
- ``bf16``: ``mpgraph.convert(step, "bf16", emulate=True)`` (no loss scaling);
- ``fp16``: ``mpgraph.convert(step, "fp16", emulate=True)`` (dynamic loss scaling).

Prints a table (final train loss, test accuracy, difference from fp32 in points, skipped
steps, final loss scale, median ms/step) and writes the loss curves of the six runs to one
PNG with two panels (MLP, CNN)::

    python3 benchmarks/train_digits.py [--steps 600] [--batch 64] [--threads 2] \
        [--plot docs/digits_loss.png] | tee benchmarks/results/digits.txt
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

import mpgraph
from mpgraph.data import dataset_for_model
from mpgraph.export import export_module
from mpgraph.runtime.metrics import Metrics
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph

POLICIES = ("fp32", "bf16", "fp16")
MODELS = ("mlp", "cnn")
LR = 3e-3
OPTIMIZER = "adamw"
TORCH_SEED = 0
DATA_SEED = 0


def make_module(kind: str) -> Any:
    """The MLP (64-64-10, ReLU) or the CNN (conv3x3 16, ReLU, conv3x3 32, ReLU, flatten, linear 10),
    initialised from ``torch.manual_seed(TORCH_SEED)``."""
    import torch

    torch.manual_seed(TORCH_SEED)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
        )
    raise ValueError(kind)


def export(kind: str, folder: str) -> str:
    """Export ``kind`` with its loss to ``folder/<kind>.loss.onnx``; returns the path."""
    import torch

    example = torch.randn(4, 64) if kind == "mlp" else torch.randn(4, 1, 8, 8)
    path = os.path.join(folder, f"{kind}.loss.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_module(make_module(kind), example, path, loss="cross_entropy")
    return path


def step_graph(loss_model: str, policy: str) -> Any:
    """A fresh AdamW step graph of ``loss_model``, converted (emulated) unless fp32.
    Built anew for every run: ``convert`` rewrites its argument in place."""
    step = build_training_graph(loss_model, optimizer=OPTIMIZER, lr=LR)
    if policy != "fp32":
        step = mpgraph.convert(step, policy, emulate=True)
    return step


@dataclass
class Run:
    model: str
    policy: str
    metrics: Metrics
    accuracy: float

    @property
    def final_loss(self) -> float:
        return self.metrics.loss[-1]

    @property
    def skipped(self) -> int:
        return int(sum(self.metrics.skipped))

    @property
    def final_scale(self) -> float | None:
        return self.metrics.loss_scale[-1] if self.metrics.loss_scale else None

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * float(np.median(self.metrics.seconds))


def train(loss_model: str, model: str, policy: str, *, steps: int, batch: int, threads: int | None) -> Run:
    """Train one variant with the shared seeds and return its metrics and test accuracy."""
    trainer = Trainer(step_graph(loss_model, policy), provider="cpu", threads=threads)
    data = dataset_for_model("digits", trainer.data_inputs)
    metrics = trainer.fit(data, steps=steps, lr=LR, batch_size=batch, seed=DATA_SEED)
    accuracy = trainer.evaluate(data.test)["accuracy"]
    return Run(model, policy, metrics, accuracy)


def run_all(*, steps: int, batch: int, threads: int | None, models: tuple[str, ...] = MODELS,
            policies: tuple[str, ...] = POLICIES) -> list[Run]:
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            loss_model = export(model, folder)
            for policy in policies:
                runs.append(train(loss_model, model, policy, steps=steps, batch=batch, threads=threads))
    return runs


def table(runs: list[Run]) -> str:
    base = {r.model: r.accuracy for r in runs if r.policy == "fp32"}
    base_loss = {r.model: np.asarray(r.metrics.loss) for r in runs if r.policy == "fp32"}
    head = (f"{'model':<5} {'policy':<6} {'final loss':>11} {'mean last 50':>12} {'test acc':>9} "
            f"{'diff (pts)':>10} {'skipped':>7} {'loss scale':>10} {'ms/step':>8} {'max rel dloss':>13}")
    lines = [head, "-" * len(head)]
    for r in runs:
        diff = 100.0 * (r.accuracy - base[r.model]) if r.model in base else math.nan
        scale = "-" if r.final_scale is None else f"{r.final_scale:g}"
        last50 = float(np.mean(r.metrics.loss[-50:]))
        rel = "-"
        ref = base_loss.get(r.model)
        if r.policy != "fp32" and ref is not None and len(ref) == len(r.metrics.loss):
            rel = f"{float(np.max(np.abs(np.asarray(r.metrics.loss) - ref) / np.abs(ref))):.2e}"
        lines.append(
            f"{r.model:<5} {r.policy:<6} {r.final_loss:>11.3e} {last50:>12.3e} {100 * r.accuracy:>8.2f}% "
            f"{diff:>+10.2f} {r.skipped:>7d} {scale:>10} {r.ms_per_step:>8.3f} {rel:>13}"
        )
    return "\n".join(lines)


def plot(runs: list[Run], path: str, title: str) -> None:
    """Two panels (MLP, CNN), loss against step on a log scale, skipped steps marked x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r.model == m for r in runs)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), dpi=100, squeeze=False)
    styles = {"fp32": dict(linewidth=2.2, alpha=0.6), "bf16": dict(linewidth=1.0), "fp16": dict(linewidth=1.0, linestyle="--")}
    for ax, model in zip(axes[0], models):
        for r in (r for r in runs if r.model == model):
            steps = np.asarray(r.metrics.step)
            loss = np.asarray(r.metrics.loss, dtype=np.float64)
            line, = ax.plot(steps, loss, label=f"{r.policy} (test {100 * r.accuracy:.1f}%)", **styles.get(r.policy, {}))
            skipped = np.asarray(r.metrics.skipped, dtype=bool)
            if skipped.any():
                y = np.where(np.isfinite(loss[skipped]), loss[skipped], np.nanmax(loss[np.isfinite(loss)]))
                ax.scatter(steps[skipped], y, marker="x", s=20, color=line.get_color(), label=f"{r.policy}: skipped steps")
        ax.set_yscale("log")
        ax.set_title(model.upper())
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (cross entropy)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (0: ORT's default)")
    parser.add_argument("--plot", default="docs/digits_loss.png", help="PNG of the loss curves ('' for none)")
    args = parser.parse_args(argv)

    print("$ python3 " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    import onnxruntime as ort
    import torch

    print(f"# mpgraph {getattr(mpgraph, '__version__', '?')}, onnxruntime {ort.__version__}, torch {torch.__version__}, "
          f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"ORT threads {args.threads or 'default'}")
    from mpgraph.data import load_dataset

    digits = load_dataset("digits")
    n_train, n_test = (len(next(iter(split.values()))) for split in (digits.train, digits.test))
    print(f"# digits ({n_train} train / {n_test} test), {args.steps} steps, batch {args.batch}, {OPTIMIZER} lr {LR:g}, "
          f"torch seed {TORCH_SEED}, data seed {DATA_SEED}; bf16/fp16 are CPU-emulated lowerings "
          f"(fp16 with dynamic loss scaling, bf16 without)")
    start = time.perf_counter()
    runs = run_all(steps=args.steps, batch=args.batch, threads=args.threads or None)
    print()
    print(table(runs))
    print()
    print("final loss: the last step's loss; diff: test accuracy minus fp32's, in percentage points;")
    print("skipped: steps whose gradients were not finite (update skipped); ms/step: median wall time of a step;")
    print("max rel dloss: largest |loss - fp32 loss| / fp32 loss over all steps (same batches); nonzero means the")
    print("low-precision run really computes differently from fp32 (it is not the same graph run twice).")
    if args.plot:
        plot(runs, args.plot, f"digits, {args.steps} steps, batch {args.batch}, {OPTIMIZER} lr {LR:g}, ORT CPU (emulated low precision)")
        print(f"loss curves: {args.plot}")
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
