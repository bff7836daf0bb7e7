"""Finite-difference check of every onnx-wheel real model's step graph: the errors per model.

Runs ``tests/test_train_graph.py``'s own check (``_directional_check``: an mse loss on the first
float output, the directional derivative along the normalized gradient plus a random direction,
fp32 central differences at steps 1e-3, 1e-4, 1e-5 until one is within the model's tolerance)
and prints, per model, the relative error at each step tried, then how many models agree to a
few thresholds::

    python3 benchmarks/fd_real_models.py | tee benchmarks/results/fd_real_models.txt
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402

from tests import test_train_graph as t  # noqa: E402


def main() -> int:
    print("$ python3 benchmarks/fd_real_models.py")
    print(f"# onnxruntime {ort.__version__}, ORT and torch at 1 thread; VGG-19 is not in the table (see REAL)")
    best: dict[str, float] = {}
    for path in t.REAL:
        name = t._real_id(path)
        start = time.perf_counter()
        errors = t._directional_check(path)
        best[name] = min(errors)
        steps = " ".join(f"{e:.2e}" for e in errors)
        print(f"{name:45s} best {best[name]:.2e}  (steps tried: {steps})  {time.perf_counter() - start:.1f} s", flush=True)
    print()
    print(f"{len(best)} models, all within their tolerance (FD_TOLERANCE {t.FD_TOLERANCE:g}, or FD_TOLERANCE_MEASURED)")
    for bound in (1e-4, 5e-4, 1.2e-3, 5e-3, 1e-2):
        print(f"  best error <= {bound:g}: {sum(e <= bound for e in best.values())}")
    worst = sorted(best.items(), key=lambda kv: kv[1])[-7:]
    print("  worst: " + ", ".join(f"{k} {v:.1e}" for k, v in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
