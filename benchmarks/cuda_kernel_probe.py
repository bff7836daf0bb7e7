"""Which ops of the presets' infer/clear lists have float16 / bfloat16 kernels on ORT CUDA.

Builds a one-node model per (op, dtype), opens it on CUDA with CPU fallback disabled, runs it
once, and prints ok / the first line of ORT's error. A preset that lowers an op without a
kernel on the target provider gives a step graph ORT refuses (bf16 comparisons did, on
ORT 1.31.1).

Run on a machine with onnxruntime-gpu::

    python3 benchmarks/cuda_kernel_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

DTYPES = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
SHAPE = [2, 4, 4, 4]
# op -> (number of same-typed float inputs, attributes, extra inputs as (name, TensorProto type, value))
OPS: dict[str, tuple[int, dict, list]] = {
    **{op: (2, {}, []) for op in ("Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Equal",
                                  "Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "PRelu")},
    **{op: (1, {}, []) for op in ("Relu", "Neg", "Abs", "Sqrt", "Erf", "Tanh", "Sigmoid", "HardSigmoid",
                                  "HardSwish", "Elu", "Selu", "LeakyRelu", "Identity", "Flatten",
                                  "GlobalAveragePool", "GlobalMaxPool", "IsNaN", "IsInf")},
    "Gelu": (1, {}, []),
    "Clip": (1, {}, []),
    "Transpose": (1, {"perm": [0, 2, 3, 1]}, []),
    "SpaceToDepth": (1, {"blocksize": 2}, []),
    "DepthToSpace": (1, {"blocksize": 2}, []),
    "MaxPool": (1, {"kernel_shape": [2, 2]}, []),
    "AveragePool": (1, {"kernel_shape": [2, 2]}, []),
    "ReduceMax": (1, {}, []),
    "ReduceMin": (1, {}, []),
    "Where": (2, {}, [("cond", TensorProto.BOOL, np.ones(SHAPE, bool))]),
    "Reshape": (1, {}, [("shape", TensorProto.INT64, np.array([2, -1], np.int64))]),
    "Expand": (1, {}, [("shape", TensorProto.INT64, np.array([3, 2, 4, 4, 4], np.int64))]),
    "Slice": (1, {}, [("starts", TensorProto.INT64, np.array([1], np.int64)), ("ends", TensorProto.INT64, np.array([3], np.int64))]),
    "Pad": (1, {}, [("pads", TensorProto.INT64, np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))]),
    "Concat": (2, {"axis": 1}, []),
    "Split": (1, {"axis": 1, "num_outputs": 2}, []),
    "Squeeze": (1, {}, [("axes", TensorProto.INT64, np.array([], np.int64))]),
    "Unsqueeze": (1, {}, [("axes", TensorProto.INT64, np.array([0], np.int64))]),
    "Tile": (1, {}, [("repeats", TensorProto.INT64, np.array([1, 2, 1, 1], np.int64))]),
    "Gather": (1, {}, [("indices", TensorProto.INT64, np.array([0, 1], np.int64))]),
    "Dropout": (1, {}, []),
}


def model(op: str, elem: int, opset: int = 22):
    n_float, attrs, extra = OPS[op]
    floats = [f"x{i}" for i in range(n_float)]
    inputs = ([e[0] for e in extra[:1]] + floats) if op == "Where" else floats + [e[0] for e in extra]
    outputs = ["y0", "y1"] if op == "Split" else ["y0"]
    node = helper.make_node(op, inputs, outputs, **attrs)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(x, elem, SHAPE) for x in floats]
        + [helper.make_tensor_value_info(name, t, list(v.shape)) for name, t, v in extra],
        [onnx.ValueInfoProto(name=y) for y in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10), floats, extra


def probe(op: str, dtype: str, opset: int) -> str:
    proto, floats, extra = model(op, DTYPES[dtype], opset)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CUDAExecutionProvider"])
        feeds = {}
        for x in floats:
            if dtype == "float":
                value = ort.OrtValue.ortvalue_from_numpy(np.ones(SHAPE, np.float32))
            else:  # 1.0 as raw bits
                bits = np.full(SHAPE, 0x3C00 if dtype == "float16" else 0x3F80, np.uint16)
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, DTYPES[dtype])
            feeds[x] = value
        for name, _, v in extra:
            feeds[name] = ort.OrtValue.ortvalue_from_numpy(v)
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        for out in session.get_outputs():
            binding.bind_output(out.name, "cpu")
        session.run_with_iobinding(binding)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the probe reports whatever ORT says
        return str(e).splitlines()[0][:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--opsets", default="18,21,22", help="opset versions of the one-node models")
    args = parser.parse_args()
    print("onnxruntime", ort.__version__, ort.get_available_providers())
    columns = [(dtype, int(opset)) for opset in args.opsets.split(",") for dtype in DTYPES]
    table = {op: {f"{d}@{o}": probe(op, d, o) for d, o in columns} for op in OPS}
    for op, row in table.items():
        print(f"{op:18s} " + "  ".join(f"{c}: {'ok' if r == 'ok' else 'NO'}" for c, r in row.items()))
    missing = {c: [op for op, row in table.items() if row[c] != "ok"] for c in next(iter(table.values()))}
    print("no kernel:", json.dumps(missing))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cuda_kernels.json"), "w") as f:
            json.dump({"onnxruntime": ort.__version__, "table": table, "missing": missing}, f, indent=1)


if __name__ == "__main__":
    main()
