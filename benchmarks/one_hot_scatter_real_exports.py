"""``mpgraph.kernels.deterministic.one_hot_scatter`` on step graphs of models this project did
not write: transformers configs with random init from the test corpus (``tests/corpus``),
exported with both torch exporters. For each: how many scatter-adds it rewrote, and the AdamW
losses over the corpus' steps of the rewritten step graph against the plain one on ORT CPU
(they may differ by float32 summation order only).

    python3 benchmarks/one_hot_scatter_real_exports.py [--cases gpt2,bert,llama,qwen2,t5]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.kernels.deterministic import one_hot_scatter  # noqa: E402
from tests.corpus import check, models  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="gpt2,bert,llama,qwen2,t5")
    args = p.parse_args()
    for name in args.cases.split(","):
        case = getattr(models, name)()
        for exporter in check.EXPORTERS:
            try:
                exported = check.export(case, exporter)
            except check.ExportFailed as e:  # torch could not export it: the corpus skips it too
                print(f"{name:8s} {exporter:11s} not exported: {str(e)[:100]}")
                continue
            plain = check.adamw_step(exported)
            model = ir.from_proto(onnx.load_from_string(plain))
            count = one_hot_scatter(model)
            rewritten = ir.to_proto(model).SerializeToString()
            a, b = check.run_steps(plain, case), check.run_steps(rewritten, case)
            worst = float(np.max(np.abs(np.array(a) - np.array(b)) / np.abs(np.array(a))))
            print(f"{name:8s} {exporter:11s} {count} scatter-add(s) rewritten; {len(a)} losses, worst relative "
                  f"difference {worst:.1e} (first {a[0]:.6f}, last {a[-1]:.6f} vs {b[-1]:.6f})", flush=True)


if __name__ == "__main__":
    main()
