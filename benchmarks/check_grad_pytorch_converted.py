"""``check_grad`` over the onnx wheel's pytorch-converted single-module exports.

Each ``pytorch-converted/*/model.onnx`` is checked with ``check_grad(path, loss="mse")`` (its
own weights, seeded inputs); prints per model ``pass`` (every parameter agrees, none noisy),
``noisy`` (some parameter only within the differences' spread), ``FAIL``, or the one-line
error (models without a float parameter are refused: nothing to train), then the counts::

    python3 benchmarks/check_grad_pytorch_converted.py | tee benchmarks/results/check_grad_pytorch_converted.txt
"""

from __future__ import annotations

import collections
import glob
import os
import sys
from pathlib import Path

import onnx

import mpgraph
from mpgraph.errors import MpgraphError


def main() -> int:
    print("$ python3 benchmarks/check_grad_pytorch_converted.py")
    root = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "pytorch-converted"
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(glob.glob(str(root / "*" / "model.onnx"))):
        name = Path(path).parent.name
        try:
            report = mpgraph.check_grad(path, loss="mse")
        except MpgraphError as e:
            outcome = f"refused: {str(e).splitlines()[0][:120]}"
            counts["refused" + (" (nothing to train)" if "nothing to train" in str(e) else "")] += 1
        else:
            statuses = collections.Counter(p.status for p in report.params)
            outcome = "FAIL" if not report.passed else ("noisy" if statuses["noisy"] else "pass")
            counts[outcome] += 1
            outcome += f" ({dict(statuses)})"
        print(f"{name:45s} {outcome}", flush=True)
    print()
    print(f"{sum(counts.values())} models: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
