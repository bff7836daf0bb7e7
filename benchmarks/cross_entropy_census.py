"""What the ``cross_entropy`` rule does to a full bf16 step graph's CUDA plan, counted on the CPU.

The graph is specialised to ``--shapes`` and planned with every CUDA rule (``Target("cuda",
"default", sdpa=True)``, counted as ``step_census.py`` counts) once without ``cross_entropy`` and
once with it. Printed for each: the bytes every node reads and writes (each input and output of
each node; constants under 1 KiB left out; Reshapes counted though ORT runs them as views), with
the time those bytes take at 3 TB/s, the float32 tensors of the logits' size left, and the
largest nodes; then the op types whose bytes changed.

    python3 benchmarks/cross_entropy_census.py DIR/gpt2_torchscript_bf16.onnx   # prepare()'s step graphs
    python3 benchmarks/cross_entropy_census.py DIR/llama_dynamo_bf16.onnx
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import onnx_ir as ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_census import SHAPES, lowered  # noqa: E402
from step_census import op_key as _key  # noqa: E402
from step_census import value_bytes as _bytes  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args(argv)
    counts = []
    for fused in (False, True):
        model, applied_list = lowered(args.model, args.shapes, set() if fused else {"cross_entropy"})
        applied = dict(applied_list)
        by: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        rows = []
        for node in model.graph:
            moved = sum(_bytes(v) for v in (*node.inputs, *node.outputs))
            by[_key(node)][0] += 1
            by[_key(node)][1] += moved
            rows.append((moved, _key(node), node.name))
        sce = [n for n in model.graph if n.op_type in ("SoftmaxCrossEntropyRows", "SoftmaxCrossEntropyLoss")]
        logits = max((_bytes(n.inputs[0]) // n.inputs[0].dtype.itemsize for n in sce), default=0)
        big = sum(_bytes(v) for n in model.graph for v in n.outputs
                  if v.dtype == ir.DataType.FLOAT and logits and _bytes(v) >= 4 * logits * 0.99)
        total = sum(b for _, b in by.values())
        print(f"== {'with' if fused else 'without'} cross_entropy ({applied.get('cross_entropy', 0)} fused): "
              f"{total / 1e9:.2f} GB moved, {total / 3e12 * 1e3:.2f} ms at 3 TB/s; float32 tensors of the logits' "
              f"size: {big / 1e9:.2f} GB")
        for moved, key, name in sorted(rows, reverse=True)[:10]:
            print(f"  {moved / 1e6:9.1f} MB  {key:40s} {name[:70]}")
        counts.append(by)
    print("== op types whose bytes changed: nodes and GB without -> with")
    before, after = counts
    for key in sorted(set(before) | set(after), key=lambda k: -abs(before[k][1] - after[k][1])):
        if before[key][1] != after[key][1]:
            print(f"  {key:40s} {before[key][0]:4d} -> {after[key][0]:4d}  {before[key][1] / 1e9:7.3f} -> "
                  f"{after[key][1] / 1e9:7.3f}")


if __name__ == "__main__":
    main()
