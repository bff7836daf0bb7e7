"""ORT CPU's ``Transpose`` against the kernel library's ``Permute``, one op per session, on the
transposes of the Nature DQN's CPU step (``mpgraph.kernels.permute``).

For each shape and permutation: whether ``fast_transposes`` rewrites it, the minimum over 7
repeats of the mean of ``--runs`` session runs for each (session overhead included, about
0.01 ms), and a check that both give numpy's transpose bit for bit.

    python3 benchmarks/cpu_transpose_ab.py [--threads 2] [--runs 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph import kernels  # noqa: E402
from mpgraph.kernels.permute import fast_transposes  # noqa: E402

CASES = [
    # (what it is in the DQN's step, shape, perm)
    ("4x4/2 weight gradient's filter reorder (dy)", [8, 8, 4, 8, 9, 9], [0, 2, 4, 5, 3, 1]),
    ("3x3/1 layer's filter reorder", [8, 8, 8, 8, 3, 3], [0, 2, 4, 5, 3, 1]),
    ("4x4/2 layer's filter reorder", [8, 4, 4, 8, 4, 4], [0, 2, 4, 5, 3, 1]),
    ("phase interleave of the 4x4/2 data gradient", [32, 32, 2, 2, 10, 10], [0, 1, 4, 2, 5, 3]),
    ("slices weight gradient's [taps, C, M] -> [M, C, taps]", [9, 64, 64], [2, 1, 0]),
    ("dy rows NCHW -> NHWC", [32, 64, 7, 7], [0, 2, 3, 1]),
    ("batch/channel swap of x (left to ORT)", [32, 4, 84, 84], [1, 0, 2, 3]),
    ("batch/channel swap of x (left to ORT)", [32, 32, 20, 20], [1, 0, 2, 3]),
]


def _model(shape: list[int], perm: list[int]) -> ir.Model:
    graph = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=perm)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    return ir.from_proto(proto)


def _session(model: ir.Model, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(kernels.library("cpu")))
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _time(session: ort.InferenceSession, x: np.ndarray, runs: int) -> float:
    session.run(None, {"x": x})
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(runs):
            session.run(None, {"x": x})
        best = min(best, (time.perf_counter() - start) / runs)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=100)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'shape':24s} {'perm':20s} {'Permute?':8s} {'ORT ms':>8s} {'Permute ms':>10s}  what")
    for what, shape, perm in CASES:
        x = rng.standard_normal(shape).astype(np.float32)
        lowered = _model(shape, perm)
        rewritten = fast_transposes(lowered)
        plain, fast = _session(_model(shape, perm), args.threads), _session(lowered, args.threads)
        expected = np.transpose(x, perm)
        assert np.array_equal(plain.run(None, {"x": x})[0], expected)
        assert np.array_equal(fast.run(None, {"x": x})[0], expected)
        print(f"{str(shape):24s} {str(perm):20s} {'yes' if rewritten else 'no':8s} {_time(plain, x, args.runs):8.3f} "
              f"{_time(fast, x, args.runs):10.3f}  {what}")


if __name__ == "__main__":
    main()
