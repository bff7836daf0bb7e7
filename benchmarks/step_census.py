"""Where a step graph's memory traffic goes once lowered for CUDA, counted on the CPU (no GPU).

A full-size step graph (``real_models.py``'s ``prepare`` writes them) is specialised to
``--shapes`` and planned with every rule the CUDA default runs (``Target("cuda", "default",
sdpa=True, gemm_bias=True)``: the library's fused attention and cuBLASLt GemmBias assumed
present), less those named in
``--without``. Then every node's bytes (each input and output it reads or writes; constants under
1 KiB left out) are summed by op (a Cast by its target type), with the time they take at
3 TB/s (about what the H200's elementwise kernels reach). ``Reshape``/``Flatten`` are listed but
counted apart: ORT runs them as views. An estimate of traffic, not a timing: GEMMs are
compute-bound, and kernels reach different fractions of the bandwidth.

    python3 benchmarks/real_models.py --out DIR ...   # or prepare() for one model: the step graphs
    python3 benchmarks/step_census.py DIR/gpt2_torchscript_bf16.onnx
    python3 benchmarks/step_census.py DIR/gpt2_torchscript_bf16.onnx --without cross_entropy,pointwise,sdpa_layout
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np
import onnx_ir as ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.lowering.registry import RULES, Target  # noqa: E402
from mpgraph.lowering.specialize import specialize_shapes  # noqa: E402

#: Bytes a second the estimate assumes.
BANDWIDTH = 3e12
#: Ops ORT runs as views of their input (no kernel, no traffic).
VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
#: The real_models decoders' batch.
SHAPES = '{"input_ids": [8, 1024], "labels": [8, 1024]}'


def value_bytes(value: ir.Value | None) -> int:
    """``value``'s size when its shape is static (a constant under 1 KiB: 0)."""
    if value is None or value.shape is None or value.dtype is None or not value.shape.is_static():
        return 0
    size = int(np.prod([int(d) for d in value.shape])) * value.dtype.itemsize
    return 0 if value.const_value is not None and value.producer() is None and size < 1024 else size


def op_key(node: ir.Node) -> str:
    key = (node.domain + "::" if node.domain else "") + node.op_type
    if node.op_type == "Cast":
        key += "->" + ir.DataType(node.attributes["to"].as_int()).name
    return key


def census(model: ir.Model) -> dict[str, list[int]]:
    """Op key -> [nodes, bytes read and written]."""
    by: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for node in model.graph:
        entry = by[op_key(node)]
        entry[0] += 1
        entry[1] += sum(value_bytes(v) for v in [*node.inputs, *node.outputs])
    return by


def lowered(path: str, shapes: str, without: set[str]) -> tuple[ir.Model, list[tuple[str, int]]]:
    """The graph at ``path``, specialised and lowered with the CUDA default rules but ``without``."""
    model = specialize_shapes(ir.load(path), json.loads(shapes))
    target = Target("cuda", "default", sdpa=True, gemm_bias=True)
    applied = [(r.name, r.apply(model, target)) for r in RULES if r.runs("cuda", "default") and r.name not in without]
    return model, applied


def totals(by: dict[str, list[int]]) -> tuple[int, int]:
    """(bytes of kernels, bytes of views)."""
    views = sum(v[1] for k, v in by.items() if k in VIEWS)
    return sum(v[1] for v in by.values()) - views, views


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--without", default="", help="comma-separated lowering rules left out")
    parser.add_argument("--top", type=int, default=30, help="ops listed")
    args = parser.parse_args(argv)
    model, applied = lowered(args.graph, args.shapes, {w for w in args.without.split(",") if w})
    by = census(model)
    kernels, views = totals(by)
    print(f"# {args.graph} {args.shapes}\n# rules: {applied}")
    print(f"bytes moved by kernels {kernels / 1e9:.2f} GB ({kernels / BANDWIDTH * 1e3:.2f} ms at "
          f"{BANDWIDTH / 1e12:.0f} TB/s); by views, which ORT does not copy, {views / 1e9:.2f} GB")
    for key, (count, size) in sorted(by.items(), key=lambda kv: -kv[1][1])[:args.top]:
        note = "  (view)" if key in VIEWS else ""
        print(f"  {key:45s} {count:5d} {size / 1e9:8.3f} GB {size / BANDWIDTH * 1e3:7.2f} ms{note}")


if __name__ == "__main__":
    main()
