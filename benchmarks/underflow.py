"""The underflow table alone: gradients ~1e-8 through a 64x64 MatMul, zeros per policy.

``benchmarks/gpu_train.py`` computes it after its GPT and ResNet runs; this prints just the
table (``underflow_table``), by default on CPU with the emulated lowerings::

    python3 benchmarks/underflow.py [--provider cpu|cuda] | tee benchmarks/results/underflow_cpu.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402

from benchmarks.gpu_train import underflow_table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    emulate = args.provider == "cpu"
    print(f"$ python3 benchmarks/underflow.py --provider {args.provider}")
    print(f"# onnxruntime {ort.__version__}, {'emulated' if emulate else 'native'} lowerings")
    for label, row in underflow_table(args.provider, emulate).items():
        print(f"underflow {label:22s} zero {row['zero_fraction']:.1%}  rel err {row['rel_error_vs_fp32']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
