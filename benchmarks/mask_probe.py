"""What the attention mask costs on ORT CUDA, per formulation, on the benchmark GPT's scores.

The exported GPT fills masked attention scores with ``Where(causal, scores, -inf)``: on the
H200 step that is ORT's broadcasting ternary kernel, 8 calls and 0.75 ms per bf16 step. Adding
a precomputed ``0 / -inf`` bias gives the same values bit for bit (``x + 0 = x``,
``x + -inf = -inf`` for finite x), through a binary kernel. This probe times, on
``[batch, heads, T, T]`` scores:

- ``where``: ``Where(cond[T, T], x, -inf)`` (the export), and ``where4d`` with ``cond[1, 1, T, T]``;
- ``add``: ``Add(x, bias[T, T])``, and ``add4d`` with ``bias[1, 1, T, T]``;
- ``softmax``: ``Softmax(x)`` alone, for scale.

    python3 benchmarks/mask_probe.py            # on the GPU machine (onnxruntime-gpu)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_probe import time_binding  # noqa: E402

DTYPES = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}


def build(variant: str, shape: list[int], dtype: int) -> onnx.ModelProto:
    t = shape[-1]
    side = [t, t] if variant in ("where", "add") else [1, 1, t, t]
    x = helper.make_tensor_value_info("x", dtype, shape)
    y = helper.make_tensor_value_info("y", dtype, shape)
    if variant.startswith("where"):
        causal = np.tril(np.ones((t, t), dtype=bool)).reshape(side)
        inits = [helper.make_tensor("cond", TensorProto.BOOL, side, causal.reshape(-1).tolist()),
                 helper.make_tensor("ninf", dtype, [], [float("-inf")])]
        node = helper.make_node("Where", ["cond", "x", "ninf"], ["y"])
    elif variant.startswith("add"):
        bias = np.where(np.tril(np.ones((t, t), dtype=bool)), 0.0, -np.inf).reshape(side)
        inits = [helper.make_tensor("bias", dtype, side, bias.reshape(-1).tolist())]
        node = helper.make_node("Add", ["x", "bias"], ["y"])
    else:
        inits = []
        node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    graph = helper.make_graph([node], variant, [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def time_variant(model: onnx.ModelProto, shape: list[int], np_dtype: str, iters: int) -> float:
    import torch

    session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[np_dtype]
    x = torch.randn(shape, dtype=tdt, device="cuda")
    y = torch.empty_like(x)
    binding = session.io_binding()
    elem = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[np_dtype]
    binding.bind_input("x", "cuda", 0, elem, shape, x.data_ptr())
    binding.bind_output("y", "cuda", 0, elem, shape, y.data_ptr())
    return time_binding(session, binding, iters)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,16,512,512")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    shape = [int(s) for s in args.shape.split(",")]
    print(f"scores {shape}; ms per call (host-timed over {args.iters} calls, includes one launch each)")
    for dtype in ("bfloat16", "float32"):
        for variant in ("where", "where4d", "add", "add4d", "softmax"):
            ms = time_variant(build(variant, shape, DTYPES[dtype]), shape, dtype, args.iters)
            print(f"  {dtype:9s} {variant:8s} {ms:7.4f} ms")


if __name__ == "__main__":
    main()
