"""What the ``pointwise`` rule does to a full bf16 step graph's CUDA plan, counted on the CPU.

The graph is specialised to ``--shapes`` and planned with every CUDA rule (``Target("cuda",
"default", sdpa=True)``, counted as ``step_census.py`` counts) but ``pointwise``; then
``pointwise`` runs. Printed: kernels made and nodes replaced, and the bytes every node reads and
writes (each input and output of each node; constants under 1 KiB left out; Reshapes counted
though ORT runs them as views) by op before and after, with the time those bytes take at
3 TB/s; and the programs most often made.

    python3 benchmarks/pointwise_census.py DIR/gpt2_torchscript_bf16.onnx
    python3 benchmarks/pointwise_census.py DIR/llama_dynamo_bf16.onnx \\
        --shapes '{"input_ids": [8, 1024], "labels": [8, 1024]}'
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_census import SHAPES, census, lowered  # noqa: E402

from mpgraph.lowering.pointwise import fuse_pointwise  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph")
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args(argv)
    model, applied = lowered(args.graph, args.shapes, {"pointwise"})
    before, nodes = census(model), model.graph.num_nodes()
    made = fuse_pointwise(model, low=True)
    after = census(model)
    print(f"# {args.graph} {args.shapes}\n# rules before: {applied}")
    replaced = nodes - model.graph.num_nodes() + made
    print(f"pointwise: {made} Pointwise kernels replace {replaced} nodes ({nodes} -> {model.graph.num_nodes()} nodes)")
    total_b, total_a = (sum(v[1] for v in c.values()) for c in (before, after))
    views = before.get("Reshape", [0, 0])[1] - after.get("Reshape", [0, 0])[1]
    print(f"bytes moved {total_b / 1e9:.2f} -> {total_a / 1e9:.2f} GB ({(total_b - total_a) / 1e9:.2f} GB less, "
          f"{views / 1e9:.2f} GB of it Reshapes; {(total_b - total_a) / 3e12 * 1e3:.2f} ms at 3 TB/s)")
    for key in sorted(set(before) | set(after), key=lambda k: -before.get(k, [0, 0])[1]):
        b, a = before.get(key, [0, 0]), after.get(key, [0, 0])
        if b != a:
            print(f"  {key:32s} {b[0]:5d} {b[1] / 1e9:7.3f} GB -> {a[0]:5d} {a[1] / 1e9:7.3f} GB")
    programs = collections.Counter(n.attributes["program"].as_string() for n in model.graph if n.op_type == "Pointwise")
    for program, count in programs.most_common(8):
        print(f"  {count:4d} x {program}")


if __name__ == "__main__":
    main()
