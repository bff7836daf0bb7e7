"""What one AdamW update over N float32 parameters costs on ORT CUDA, per formulation.

The GPT step's optimizer is about a fifth of its GPU time: each ONNX elementwise op is its own
kernel and pass over memory, where torch fuses several. This probe times candidate ONNX
formulations of the same update on one flat tensor (so launches don't matter), next to torch's
``foreach`` and ``fused`` AdamW on the same tensor:

- ``current``: ``mpgraph.optim.adam``'s 14 ops (torch's operation order).
- ``no-div``: the bias-corrected square root folded into the step size and epsilon (13 ops).
- ``gemm-axpy``: the moment updates ``b*m + c*g`` as a ``Gemm`` with K=1 (cuBLAS's
  ``beta*C + A@B``), 11 ops.

    python3 benchmarks/optim_probe.py --n 118000000     # on the GPU machine (onnxruntime-gpu)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.01


def _const(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value]))


def build(variant: str, n: int) -> onnx.ModelProto:
    """p, g, m, v [n] and the scalars step_size, bcs (sqrt of bias correction 2), decay."""
    nodes = [_const(k, v) for k, v in (("c1", 1 - B1), ("b2", B2), ("c2", 1 - B2), ("eps", EPS))]
    if variant == "gemm-axpy":
        shape = [n, 1]
        nodes += [
            helper.make_node("Reshape", ["c1", "one11"], ["c1m"]),
            helper.make_node("Reshape", ["c2", "one11"], ["c2m"]),
            helper.make_node("Gemm", ["g", "c1m", "m"], ["m_new"], beta=B1),
            helper.make_node("Mul", ["g", "g"], ["gg"]),
            helper.make_node("Gemm", ["gg", "c2m", "v"], ["v_new"], beta=B2),
            helper.make_node("Sqrt", ["v_new"], ["sq"]),
            helper.make_node("Mul", ["bcs", "eps"], ["eps2"]),
            helper.make_node("Add", ["sq", "eps2"], ["den"]),
            helper.make_node("Div", ["m_new", "den"], ["r"]),
            helper.make_node("Mul", ["step_size", "bcs"], ["s2"]),
            helper.make_node("Mul", ["r", "s2"], ["u"]),
            helper.make_node("Mul", ["p", "decay"], ["pd"]),
            helper.make_node("Sub", ["pd", "u"], ["p_new"]),
        ]
        extra = [helper.make_tensor("one11", TensorProto.INT64, [2], [1, 1])]
    else:
        shape = [n]
        nodes += [
            helper.make_node("Mul", ["p", "decay"], ["pd"]),
            helper.make_node("Sub", ["g", "m"], ["gm"]),
            helper.make_node("Mul", ["gm", "c1"], ["gmc"]),
            helper.make_node("Add", ["m", "gmc"], ["m_new"]),
            helper.make_node("Mul", ["v", "b2"], ["vb"]),
            helper.make_node("Mul", ["g", "g"], ["gg"]),
            helper.make_node("Mul", ["gg", "c2"], ["ggc"]),
            helper.make_node("Add", ["vb", "ggc"], ["v_new"]),
            helper.make_node("Sqrt", ["v_new"], ["sq"]),
        ]
        if variant == "current":
            nodes += [helper.make_node("Div", ["sq", "bcs"], ["sqb"]), helper.make_node("Add", ["sqb", "eps"], ["den"]),
                      helper.make_node("Div", ["m_new", "den"], ["r"]), helper.make_node("Mul", ["r", "step_size"], ["u"])]
        else:
            nodes += [helper.make_node("Mul", ["bcs", "eps"], ["eps2"]), helper.make_node("Add", ["sq", "eps2"], ["den"]),
                      helper.make_node("Div", ["m_new", "den"], ["r"]), helper.make_node("Mul", ["step_size", "bcs"], ["s2"]),
                      helper.make_node("Mul", ["r", "s2"], ["u"])]
        nodes.append(helper.make_node("Sub", ["pd", "u"], ["p_new"]))
        extra = []
    tensors = [helper.make_tensor_value_info(k, TensorProto.FLOAT, shape) for k in ("p", "g", "m", "v")]
    scalars = [helper.make_tensor_value_info(k, TensorProto.FLOAT, []) for k in ("step_size", "bcs", "decay")]
    outs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, shape) for k in ("p_new", "m_new", "v_new")]
    graph = helper.make_graph(nodes, variant, tensors + scalars, outs, initializer=extra)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def time_ort(variant: str, n: int, iters: int) -> tuple[float, np.ndarray]:
    options = ort.SessionOptions()
    sess = ort.InferenceSession(build(variant, n).SerializeToString(), options,
                                providers=[("CUDAExecutionProvider", {"use_tf32": "0"})])
    shape = [n, 1] if variant == "gemm-axpy" else [n]
    rng = np.random.default_rng(0)
    host = {k: rng.standard_normal(shape).astype(np.float32) * s for k, s in (("p", 1.0), ("g", 1e-2), ("m", 1e-3))}
    host["v"] = np.abs(rng.standard_normal(shape).astype(np.float32)) * 1e-5
    values = {k: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for k, a in host.items()}
    for k, x in (("step_size", 1e-3 / (1 - B1)), ("bcs", (1 - B2) ** 0.5), ("decay", 1 - 1e-3 * WD)):
        values[k] = ort.OrtValue.ortvalue_from_numpy(np.array(x, dtype=np.float32), "cuda", 0)
    outs = {k: ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cuda", 0) for k in ("p_new", "m_new", "v_new")}
    binding = sess.io_binding()
    for k, val in values.items():
        binding.bind_ortvalue_input(k, val)
    for k, val in outs.items():
        binding.bind_ortvalue_output(k, val)
    return time_binding(sess, binding, iters), outs["p_new"].numpy().reshape(-1)


def time_binding(session: ort.InferenceSession, binding: ort.IOBinding, iters: int) -> float:
    """ms per ``run_with_iobinding`` after 3 warm-up runs, timed on the host around a sync."""
    for _ in range(3):
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def time_torch(n: int, iters: int, mode: str) -> float:
    p = torch.nn.Parameter(torch.randn(n, device="cuda"))
    p.grad = torch.randn(n, device="cuda") * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=WD, **{mode: True})
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=118_000_000)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    gb = args.n * 4 / 1e9
    print(f"N = {args.n:,} float32 ({gb:.2f} GB per tensor); ms per update, median of one timed loop of {args.iters}")
    reference = None
    for variant in ("current", "no-div", "gemm-axpy"):
        try:
            ms, p_new = time_ort(variant, args.n, args.iters)
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            print(f"  ort {variant:10s} failed: {str(e).splitlines()[0][:160]}")
            continue
        if reference is None:
            reference = p_new
        diff = float(np.max(np.abs(p_new - reference)))
        print(f"  ort {variant:10s} {ms:7.3f} ms   max |p - current| {diff:.2e}")
    for mode in ("foreach", "fused"):
        print(f"  torch {mode:8s} {time_torch(args.n, args.iters, mode):7.3f} ms")


if __name__ == "__main__":
    main()
