"""Per-layer A/B of ORT CPU convolution paths for a step graph (``mpgraph.kernels.nchwc``).

For each layer shape (the Nature DQN's three, batch 32, and a ResNet 3x3/1 layer) it times,
interleaved in rounds on the same inputs:

- ``fwd``: the forward Conv with its weight as a graph input (what a step graph has: MLAS's
  im2col path), with the weight as a constant initializer (ORT's own NCHWc transformer takes
  it), and through ``to_nchwc`` (the weight reordered in the graph); torch's ``conv2d``;
- ``dW``: the weight gradient's Conv (batch and channels swapped, stride as dilation, over a
  symbolic batch) plain and through ``to_nchwc``; torch's ``conv2d_weight``;
- ``dX``: a unit-stride layer's data gradient, ``ConvTranspose`` plain and through
  ``to_nchwc`` (as the Conv it equals); torch's ``conv2d_input``.

Every rewritten result is checked against the plain one (max relative difference printed).
Times are wall ms per call at ``--threads`` threads (ORT and torch alike): min and median over
the rounds. On a shared machine compare within a line.

    python3 benchmarks/conv_nchwc_ab.py [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.kernels.nchwc import block_size, to_nchwc  # noqa: E402

LAYERS = [  # name, batch, ci, co, k, stride, pad, map
    ("dqn.conv1 8x8/4", 32, 4, 32, 8, 4, 0, 84),
    ("dqn.conv2 4x4/2", 32, 32, 64, 4, 2, 0, 20),
    ("dqn.conv3 3x3/1", 32, 64, 64, 3, 1, 0, 9),
    ("resnet 3x3/1 32x32", 32, 16, 16, 3, 1, 1, 32),
]


def _model(nodes: list, inputs: list, inits: list | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _nchwc(model: onnx.ModelProto) -> onnx.ModelProto:
    lowered = ir.from_proto(model)
    ir.passes.common.ShapeInferencePass()(lowered)
    assert to_nchwc(lowered) == 1, "to_nchwc did not take the layer"
    return ir.to_proto(lowered)


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _variants(layer: tuple, threads: int) -> dict[str, tuple[Callable[[], object], np.ndarray | None]]:
    """Each variant's call, and its result where it must equal the plain form's."""
    _, n, ci, co, k, s, pad, size = layer
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, ci, size, size)).astype(np.float32)
    w = (rng.standard_normal((co, ci, k, k)) * 0.05).astype(np.float32)
    out = (size + 2 * pad - k) // s + 1
    dy = rng.standard_normal((n, co, out, out)).astype(np.float32)
    f32 = TensorProto.FLOAT
    conv = helper.make_node("Conv", ["x", "w"], ["y"], strides=[s, s], pads=[pad] * 4)
    fwd = _model([conv], [helper.make_tensor_value_info("x", f32, x.shape), helper.make_tensor_value_info("w", f32, w.shape)])
    const = _model([conv], [helper.make_tensor_value_info("x", f32, x.shape)], [helper.make_tensor("w", f32, w.shape, w.reshape(-1))])
    dw_nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
                helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
                helper.make_node("Conv", ["xt", "dyt"], ["wt"], dilations=[s, s], pads=[pad] * 4),
                helper.make_node("Slice", ["wt", "zero", "kk", "hw"], ["ws"]),
                helper.make_node("Transpose", ["ws"], ["y"], perm=[1, 0, 2, 3])]
    dw = _model(dw_nodes, [helper.make_tensor_value_info("x", f32, ["batch", ci, size, size]),
                           helper.make_tensor_value_info("dy", f32, ["batch", co, out, out])],
                [helper.make_tensor("zero", TensorProto.INT64, [2], [0, 0]), helper.make_tensor("kk", TensorProto.INT64, [2], [k, k]),
                 helper.make_tensor("hw", TensorProto.INT64, [2], [2, 3])])
    sessions = {"fwd plain": (_session(fwd, threads), {"x": x, "w": w}), "fwd const": (_session(const, threads), {"x": x}),
                "fwd nchwc": (_session(_nchwc(fwd), threads), {"x": x, "w": w}),
                "dW plain": (_session(dw, threads), {"x": x, "dy": dy})}
    try:
        sessions["dW nchwc"] = (_session(_nchwc(dw), threads), {"x": x, "dy": dy})
    except AssertionError:
        pass  # more taps than to_nchwc takes: it keeps the plain Conv
    if s == 1:
        convt = _model([helper.make_node("ConvTranspose", ["dy", "w"], ["y"], pads=[pad] * 4)],
                       [helper.make_tensor_value_info("dy", f32, dy.shape), helper.make_tensor_value_info("w", f32, w.shape)])
        sessions["dX plain"] = (_session(convt, threads), {"dy": dy, "w": w})
        sessions["dX nchwc"] = (_session(_nchwc(convt), threads), {"dy": dy, "w": w})
    calls: dict[str, tuple[Callable[[], object], np.ndarray | None]] = {
        name: ((lambda s_=sess, f_=feeds: s_.run(None, f_)), sess.run(None, feeds)[0]) for name, (sess, feeds) in sessions.items()}
    xt, wt, dyt = (torch.from_numpy(a) for a in (x, w, dy))
    calls["fwd torch"] = (lambda: torch.nn.functional.conv2d(xt, wt, stride=s, padding=pad), None)
    calls["dW torch"] = (lambda: torch.nn.grad.conv2d_weight(xt, wt.shape, dyt, stride=s, padding=pad), None)
    if s == 1:
        calls["dX torch"] = (lambda: torch.nn.grad.conv2d_input(xt.shape, wt, dyt, stride=s, padding=pad), None)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# ORT {ort.__version__} CPU, {args.threads} threads, NCHWc block {block_size()}; {args.rounds} rounds of 5 calls,"
          " interleaved; ms per call: min / median")
    for layer in LAYERS:
        calls = _variants(layer, args.threads)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.rounds + 1):
            for name, (call, _) in calls.items():
                start = time.perf_counter()
                for _ in range(5):
                    call()
                times[name].append((time.perf_counter() - start) / 5 * 1e3)
        print(f"\n{layer[0]} (batch {layer[1]}, {layer[2]} -> {layer[3]} channels, {layer[7]}x{layer[7]})")
        for part in ("fwd", "dW", "dX"):
            names = [k for k in calls if k.startswith(part + " ")]
            if names:
                print(f"  {part:3s} " + "  ".join(f"{k.split()[1]} {min(times[k][1:]):.2f} / {np.median(times[k][1:]):.2f}" for k in names))
            plain = calls.get(f"{part} plain", (None, None))[1]
            for k in names:
                got = calls[k][1]
                if got is not None and plain is not None and k != f"{part} plain":
                    print(f"      {k}: max |diff| / max |plain| = {np.abs(got - plain).max() / np.abs(plain).max():.1e}")


if __name__ == "__main__":
    main()
