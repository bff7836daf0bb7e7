"""Optimizer trajectories against torch.optim: the errors ``tests/test_train_graph.py`` bounds.

For every zoo model and optimizer, runs the test file's ``_track`` (ORT CPU fp32 step graph vs
torch.optim in float64, same weights and batches) and prints the error of all parameters at the
end relative to the float64 run's total update: ``TUNED_STEPS`` (25) steps at the tuned rates,
1 step at the default rates, 50 steps at the default rates with the furthest of four fp32 torch
runs; then the SGD variants, unpacked optimizers, AMSGrad and Adam weight decay::

    python3 benchmarks/track_torch.py | tee benchmarks/results/track_torch.txt
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from tests import test_train_graph as t  # noqa: E402


def main() -> int:
    print("$ python3 benchmarks/track_torch.py")
    print(f"# onnxruntime {ort.__version__}, torch {torch.__version__}, 1 thread each; errors relative to the update")
    print(f"{'model':9s} {'optim':6s} {f'tuned {t.TUNED_STEPS}':>10s} {'default 1':>10s} {'default 50':>11s} {'fp32 torch':>11s}")
    for name in t.ZOO_NAMES:
        for kind in sorted(t.OPTIMIZERS):
            options = t.OPTIMIZERS[kind]
            lr = t.LR_OVERRIDES.get((name, kind), t.LEARNING_RATES[kind])
            tuned, _ = t._track(name, kind, options, lr, steps=t.TUNED_STEPS)
            one, _ = t._track(name, kind, options, t.DEFAULT_RATES[kind], steps=1)
            ours, fp32_runs = t._track(name, kind, options, t.DEFAULT_RATES[kind], check_loss=False)
            furthest = max(itertools.islice(fp32_runs, 4))
            print(f"{name:9s} {kind:6s} {tuned:10.2e} {one:10.2e} {ours:11.2e} {furthest:11.2e}", flush=True)
    variants = {
        "sgd nesterov": ("tiny_mlp", "sgd", dict(momentum=0.9, nesterov=True, weight_decay=1e-3), 0.1, 20),
        "sgd dampening": ("tiny_mlp", "sgd", dict(momentum=0.5, dampening=0.3), 0.1, 20),
        "sgd plain": ("tiny_mlp", "sgd", {}, 0.1, 20),
        **{f"unpacked {k}": ("tiny_mlp", k, {**t.OPTIMIZERS[k], "pack": False}, t.LEARNING_RATES[k], 20)
           for k in sorted(t.OPTIMIZERS)},
        **{f"amsgrad {m} {k}": (m, k, {**t.OPTIMIZERS[k], "beta2": 0.9, "amsgrad": True}, 1e-3, 30)
           for m in ("tiny_mlp", "gpt") for k in ("adam", "adamw")},
        "adam weight decay": ("tiny_mlp", "adam", dict(weight_decay=1e-2), 1e-3, 20),
    }
    print()
    for label, (name, kind, options, lr, steps) in variants.items():
        print(f"{label:24s} {t._track(name, kind, options, lr, steps=steps)[0]:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
