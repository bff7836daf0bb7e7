"""Causal attention at GPT-2 small's shape, bf16: what a fused attention would save mpgraph.

Side by side in one process on the GPU (batch 8, 12 heads, T 1024, head dim 64, causal):

- ORT CUDA, the ONNX ``Attention`` op (opset 23, ``is_causal=1``), forward;
- ORT CUDA, the materialised form as mpgraph's bf16 policy runs it: bf16 ``Q K^T`` and ``P V``
  GEMMs, the scores' scale, mask and Softmax in float32 (the policy's deny list), forward; and
  forward plus backward as ``autodiff/rules/attention.py`` writes it (dV = P^T dY,
  dS = P * (dY V^T - rowsum(dY * Y)), dQ = scale dS K, dK = scale dS^T Q; float32 between the
  bf16 GEMMs);
- torch's ``F.scaled_dot_product_attention`` with each backend it has here (flash, cuDNN,
  memory-efficient, math), forward and forward plus backward: the floor a fused kernel
  (cuDNN's SDPA through cudnn-frontend, or a flash kernel) would put under the first two.

The ORT models take and return float32 and cast to bf16 inside (numpy has no bf16 to bind);
those four casts of ``[8, 12, 1024, 64]`` are in the ORT times (tens of microseconds). All
GEMMs are bf16, so ORT's TF32 setting does not matter. Median of ``--rounds`` rounds of
``--iters`` runs, inputs and outputs on the device (IOBinding).

    python3 benchmarks/attention_ab.py [--out DIR]   # on the GPU machine, with onnxruntime-gpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import onnx
import torch
from onnx import TensorProto as T
from onnx import helper as h

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ort_timing import time_graph  # noqa: E402
from step_timing import run_header  # noqa: E402

B, H, S, D = 8, 12, 1024, 64
BF16, F32 = T.BFLOAT16, T.FLOAT


def _model(nodes: list, inputs: list[str], outputs: list[str], inits: list) -> bytes:
    shape = [B, H, S, D]
    graph = h.make_graph(nodes, "attention", [h.make_tensor_value_info(n, F32, shape) for n in inputs],
                         [h.make_tensor_value_info(n, F32, shape) for n in outputs], initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def _casts(names: list[str], to: int) -> list:
    return [h.make_node("Cast", [n], [f"{n}_{'b' if to == BF16 else 'f'}"], to=to) for n in names]


def _consts() -> list:
    mask = np.triu(np.full((S, S), -np.inf, np.float32), 1)[None, None]
    return [onnx.numpy_helper.from_array(mask, "mask"), onnx.numpy_helper.from_array(np.float32(1 / math.sqrt(D)), "scale")]


def attention_op() -> bytes:
    nodes = _casts(["q", "k", "v"], BF16) + [
        h.make_node("Attention", ["q_b", "k_b", "v_b"], ["y_b"], is_causal=1), *_casts(["y_b"], F32)]
    nodes[-1].output[0] = "y"
    return _model(nodes, ["q", "k", "v"], ["y"], [])


def _forward() -> list:
    """Q, K, V bf16 -> P (float32), P bf16 and Y bf16, as the bf16 policy places the casts."""
    return [
        h.make_node("Transpose", ["k_b"], ["kt"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", ["q_b", "kt"], ["s_b"]),
        h.make_node("Cast", ["s_b"], ["s"], to=F32),
        h.make_node("Mul", ["s", "scale"], ["s_scaled"]),
        h.make_node("Add", ["s_scaled", "mask"], ["s_masked"]),
        h.make_node("Softmax", ["s_masked"], ["p"], axis=-1),
        h.make_node("Cast", ["p"], ["p_b"], to=BF16),
        h.make_node("MatMul", ["p_b", "v_b"], ["y_b"]),
    ]


def materialised_forward() -> bytes:
    nodes = _casts(["q", "k", "v"], BF16) + _forward() + [h.make_node("Cast", ["y_b"], ["y"], to=F32)]
    return _model(nodes, ["q", "k", "v"], ["y"], _consts())


def materialised_forward_backward() -> bytes:
    nodes = _casts(["q", "k", "v", "dy"], BF16) + _forward() + [
        h.make_node("Cast", ["y_b"], ["y"], to=F32),
        h.make_node("Transpose", ["p_b"], ["pt"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", ["pt", "dy_b"], ["dv_b"]),
        h.make_node("Transpose", ["v_b"], ["vt"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", ["dy_b", "vt"], ["dp_b"]),
        h.make_node("Cast", ["dp_b"], ["dp"], to=F32),
        h.make_node("Mul", ["dy", "y"], ["dyy"]),
        h.make_node("ReduceSum", ["dyy", "last"], ["r"], keepdims=1),
        h.make_node("Sub", ["dp", "r"], ["dpr"]),
        h.make_node("Mul", ["p", "dpr"], ["ds"]),
        h.make_node("Mul", ["ds", "scale"], ["ds_scaled"]),
        h.make_node("Cast", ["ds_scaled"], ["ds_b"], to=BF16),
        h.make_node("MatMul", ["ds_b", "k_b"], ["dq_b"]),
        h.make_node("Transpose", ["ds_b"], ["dst"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", ["dst", "q_b"], ["dk_b"]),
        *[h.make_node("Cast", [f"d{n}_b"], [f"d{n}"], to=F32) for n in "qkv"],
    ]
    inits = [*_consts(), onnx.numpy_helper.from_array(np.array([-1], np.int64), "last")]
    return _model(nodes, ["q", "k", "v", "dy"], ["y", "dq", "dk", "dv"], inits)


def fused(backward: bool) -> bytes:
    """mpgraph's ``SdpaForward`` (and ``SdpaBackward``): cuDNN's fused attention (csrc/sdpa.cu)."""
    attrs = {"scale": 1 / math.sqrt(D), "is_causal": 1, "domain": "ai.mpgraph"}
    names = ["q", "k", "v", "dy"] if backward else ["q", "k", "v"]
    nodes = _casts(names, BF16) + [h.make_node("SdpaForward", ["q_b", "k_b", "v_b"], ["y_b", "stats"], **attrs),
                                   h.make_node("Cast", ["y_b"], ["y"], to=F32)]
    outputs = ["y"]
    if backward:
        nodes += [h.make_node("SdpaBackward", ["q_b", "k_b", "v_b", "y_b", "dy_b", "stats"], ["dq_b", "dk_b", "dv_b"],
                              **attrs), *[h.make_node("Cast", [f"d{n}_b"], [f"d{n}"], to=F32) for n in "qkv"]]
        outputs += ["dq", "dk", "dv"]
    shape = [B, H, S, D]
    graph = h.make_graph(nodes, "fused", [h.make_tensor_value_info(n, F32, shape) for n in names],
                         [h.make_tensor_value_info(n, F32, shape) for n in outputs])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def _library() -> str | None:
    """mpgraph's CUDA kernel library when it was built with cuDNN's SDPA, else None."""

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mpgraph.lowering.plan import has_sdpa, library

    path = str(library("cuda"))
    return path if has_sdpa(path) else None


def time_torch(backend: object, tensors: dict[str, torch.Tensor], backward: bool, rounds: int,
               iters: int) -> tuple[float, dict[str, np.ndarray]]:
    from torch.nn.attention import sdpa_kernel

    q, k, v = (tensors[n].detach().requires_grad_(backward) for n in "qkv")
    dy = tensors["dy"]

    def run() -> torch.Tensor:
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            y.backward(dy)
        return y

    with sdpa_kernel([backend]):
        for _ in range(3):
            y = run()
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                y = run()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3 / iters)
        outs = {"y": y.float().detach().cpu().numpy()}
        if backward:  # inside the backend's context: its own gradients
            q.grad = k.grad = v.grad = None
            run()
            outs |= {f"d{n}": t.grad.float().cpu().numpy() for n, t in zip("qkv", (q, k, v), strict=True)}
    return statistics.median(times), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", help="folder for attention_ab.json")
    args = p.parse_args()
    header = run_header(("torch", "onnxruntime", "onnx"))
    print(f"# command: {header['command']}\n# commit: {header['commit']}\n# date: {header['date']}\n"
          f"# gpu: {header['gpu']}\n# versions: {json.dumps(header['versions'])}")
    print(f"# causal attention, batch {B}, {H} heads, T {S}, head dim {D}, bf16; ms per call, median of "
          f"{args.rounds} rounds of {args.iters}")
    torch.manual_seed(0)
    tensors = {n: torch.randn(B, H, S, D, device="cuda").bfloat16() for n in ("q", "k", "v", "dy")}
    feeds = {n: t.float().cpu().numpy() for n, t in tensors.items()}
    rows: list[tuple[str, float, dict[str, np.ndarray]]] = []
    try:
        custom_ops = _library()
    except Exception as e:  # noqa: BLE001 - the fused rows are then left out, saying why
        custom_ops = None
        print(f"mpgraph fused rows: ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    cases = [("ort Attention op, forward", attention_op()),
             ("ort materialised, forward", materialised_forward()),
             ("ort materialised, forward+backward", materialised_forward_backward())]
    if custom_ops:
        cases += [("mpgraph SdpaForward (cuDNN), forward", fused(False)),
                  ("mpgraph Sdpa fused, forward+backward", fused(True))]
    else:
        print("# mpgraph's kernel library has no cuDNN SDPA here: no fused rows")
    for label, model in cases:
        try:
            ms, outs = time_graph(model, "cuda", feeds, args.rounds, args.iters, custom_ops if "mpgraph" in label else None)
            rows.append((label, ms, outs))
        except Exception as e:  # noqa: BLE001 - a row that fails says why; the rest still run
            print(f"{label}: ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    from torch.nn.attention import SDPBackend

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        for backward in (False, True):
            label = f"torch sdpa {name}, {'forward+backward' if backward else 'forward'}"
            try:
                ms, outs = time_torch(backend, tensors, backward, args.rounds, args.iters)
                rows.append((label, ms, outs))
            except Exception as e:  # noqa: BLE001
                print(f"{label}: ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    ref = next((o for label, _, o in rows if label == "torch sdpa math, forward+backward"), None)
    print(f"\n{'configuration':40s} {'ms':>8s}  max |diff| to torch math (y, dq, dk, dv)")
    for label, ms, outs in rows:
        diffs = [f"{float(np.abs(outs[k] - ref[k]).max()):.3g}" for k in ("y", "dq", "dk", "dv")
                 if ref is not None and k in outs]
        print(f"{label:40s} {ms:8.3f}  {' '.join(diffs)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_ab.json"), "w") as f:
            json.dump({"env": header, "rows": [{"config": label, "ms": ms} for label, ms, _ in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
