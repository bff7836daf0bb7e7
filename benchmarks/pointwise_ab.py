"""A bf16 residual block's elementwise ops on ORT CUDA with and without the ``pointwise`` rule.

The block (``block``): a GEMM's bfloat16 output plus its bias and times a scalar in bfloat16,
the float32 residual ``Add(x, Cast(., float))`` and its bfloat16 copy for the next GEMM, the
backward's float32 ``Sum(g, Cast(dx_bf16, float), g)`` through Reshapes, then a float32
Div/Mul/Sqrt/Sub chain with a float16 output: 18 ONNX ops, two ``Pointwise`` kernels lowered.
Both sessions run the same graph (the lowered one through the kernel library); median of
``--rounds`` rounds of ``--iters`` runs with inputs and outputs on the device (IOBinding);
every output compared bit for bit; the bytes each session's nodes read and write (every
input and output of every node, as ``step_census.py`` counts them) and the bandwidth
that makes.

    python3 benchmarks/pointwise_ab.py                  # the GPU machine, onnxruntime-gpu
    python3 benchmarks/pointwise_ab.py --rows 8192      # GPT-2 small's [8, 1024, 768] (default)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.lowering.pointwise import fuse_pointwise  # noqa: E402

WIDTH = 768


def block(rows: int) -> ir.Model:
    """The block on ``[rows, 768]`` tensors (the Sum's side reshaped to ``[1, rows, 768]``)."""
    shape, flat = [rows, WIDTH], [1, rows, WIDTH]
    nodes = [
        h.make_node("Cast", ["y"], ["y_bf16"], to=T.BFLOAT16),   # a GEMM's bfloat16 output
        h.make_node("Add", ["y_bf16", "bias"], ["yb"]),          # its bias, in bfloat16
        h.make_node("Mul", ["yb", "gate"], ["yg"]),              # a scalar, in bfloat16
        h.make_node("Cast", ["yg"], ["yg_f32"], to=T.FLOAT),
        h.make_node("Add", ["x", "yg_f32"], ["r"]),              # the float32 residual
        h.make_node("Cast", ["r"], ["r_bf16"], to=T.BFLOAT16),   # the next GEMM's input
        h.make_node("Cast", ["dx"], ["dx_bf16"], to=T.BFLOAT16),
        h.make_node("Cast", ["dx_bf16"], ["dx_f32"], to=T.FLOAT),
        h.make_node("Reshape", ["g", "flat"], ["g2"]),
        h.make_node("Reshape", ["dx_f32", "flat"], ["dx2"]),
        h.make_node("Sum", ["g2", "dx2", "g2"], ["s"]),          # the residual gradient, float32
        h.make_node("Div", ["s", "three"], ["q"]),
        h.make_node("Mul", ["q", "q"], ["qq"]),
        h.make_node("Sqrt", ["qq"], ["qs"]),
        h.make_node("Sub", ["qs", "q"], ["d"]),
        h.make_node("Cast", ["d"], ["d_f16"], to=T.FLOAT16),
        h.make_node("Cast", ["r_bf16"], ["r_back"], to=T.FLOAT),  # bfloat16 results come back as float32
        h.make_node("Cast", ["yg"], ["yg_back"], to=T.FLOAT),
    ]
    consts = [h.make_tensor("bias", T.BFLOAT16, [WIDTH], np.linspace(-3, 3, WIDTH, dtype=np.float32).tolist()),
              h.make_tensor("gate", T.BFLOAT16, [], [0.37]), h.make_tensor("three", T.FLOAT, [], [3.0]),
              h.make_tensor("flat", T.INT64, [3], flat)]
    inputs = [h.make_tensor_value_info(n, T.FLOAT, shape) for n in ("x", "y", "dx", "g")]
    outputs = [h.make_tensor_value_info(n, t, s) for n, t, s in (
        ("r", T.FLOAT, shape), ("r_back", T.FLOAT, shape), ("yg_back", T.FLOAT, shape), ("s", T.FLOAT, flat),
        ("d_f16", T.FLOAT16, flat))]
    proto = h.make_model(h.make_graph(nodes, "block", inputs, outputs, consts), opset_imports=[h.make_opsetid("", 20)])
    proto.ir_version = 9
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def lowered(model: ir.Model) -> ir.Model:
    out = ir.from_proto(ir.to_proto(model))
    fuse_pointwise(out)
    return out


def moved(model: ir.Model) -> int:
    """Bytes every node reads and writes (constants under 1 KiB left out)."""
    total = 0
    for node in model.graph:
        for v in [*node.inputs, *node.outputs]:
            if v is None or v.shape is None or v.dtype is None:
                continue
            size = int(np.prod([int(d) for d in v.shape])) * v.dtype.itemsize
            if not (v.const_value is not None and v.producer() is None and size < 1024):
                total += size
    return total


def main(argv: list[str] | None = None) -> None:
    import onnxruntime as ort
    from ort_timing import time_graph

    from mpgraph.lowering.plan import library

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8 * 1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    feeds = {n: (rng.standard_normal((args.rows, WIDTH)) * 41.7).astype(np.float32) for n in ("x", "y", "dx", "g")}
    plain = block(args.rows)
    fused = lowered(plain)
    print(f"# pointwise_ab.py --rows {args.rows}: onnxruntime {ort.__version__}, median of {args.rounds} x {args.iters}")
    results = {}
    for name, model, lib in (("unfused", plain, None), ("fused", fused, str(library("cuda")))):
        ms, outs = time_graph(ir.to_proto(model).SerializeToString(), "cuda", feeds, args.rounds, args.iters, lib)
        nodes = sum(1 for n in model.graph if n.op_type != "Reshape")
        results[name] = (ms, outs)
        print(f"{name:8s} {ms:7.3f} ms, {nodes:2d} kernels, {moved(model) / 1e9:6.3f} GB moved "
              f"({moved(model) / ms / 1e6:7.1f} GB/s)")
    (t_plain, want), (t_fused, got) = results["unfused"], results["fused"]
    same = {k: bool(np.array_equal(got[k].view(np.uint8), v.view(np.uint8))) for k, v in want.items()}
    print(f"saves {t_plain - t_fused:.3f} ms ({t_fused / t_plain:.2f}x); outputs bit for bit: {same}")


if __name__ == "__main__":
    main()
