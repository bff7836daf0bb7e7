"""The ``Pointwise`` CUDA kernel (``csrc/pointwise.cu``) against ORT CUDA's own elementwise ops.

A bf16 residual block's elementwise ops, natively in bfloat16 on ORT CUDA: the float32
residual ``Add(x, Cast(y_bf16, float))``, its bfloat16 copy for the next GEMM, a bias add and a
product in bfloat16, the backward's ``Sum(g, Cast(dx_bf16, float))`` and a float32 chain with a
Div and a Sqrt, with Reshapes between them, on a [8, 1000, 768] + 3 tensor (so the kernel's
four-element path and its tail both run). Lowered by the ``pointwise`` rule, every output must
equal the unlowered graph's bit for bit, NaN payloads aside (none are made here). Marked ``gpu``:
skipped without CUDA or onnxruntime-gpu. Run on a GPU machine with
``.venv/bin/python -m pytest -q -p no:randomly -n 0 -m gpu tests/test_gpu_pointwise.py``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph.lowering.pointwise import fuse_pointwise
from tests.helpers import init, make_model, vi

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
N = 8 * 1000 * 768 + 768 * 3  # a multiple of the last dim, not of 4 * 256 threads
SHAPE, FLAT = [N // 768, 768], [1, N // 768, 768]


@pytest.fixture(scope="module")
def library() -> str:
    if not HAS_CUDA:
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    from mpgraph.lowering.plan import library as build

    return str(build("cuda"))


def _block() -> ir.Model:
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
        h.make_node("Mul", ["q", "q"], ["qa"]),
        h.make_node("Sqrt", ["qa"], ["qs"]),
        h.make_node("Sub", ["qs", "q"], ["d"]),
        h.make_node("Cast", ["d"], ["d_f16"], to=T.FLOAT16),
        h.make_node("Cast", ["r_bf16"], ["r_back"], to=T.FLOAT),  # bfloat16 results come back as float32
        h.make_node("Cast", ["yg"], ["yg_back"], to=T.FLOAT),
    ]
    consts = [h.make_tensor("bias", T.BFLOAT16, [768], np.linspace(-3, 3, 768, dtype=np.float32).tolist()),
              h.make_tensor("gate", T.BFLOAT16, [], [0.37]), init("three", np.array(3.0, np.float32)),
              init("flat", np.array(FLAT, np.int64))]
    proto = make_model(nodes, [vi(n, SHAPE) for n in ("x", "y", "dx", "g")],
                       [vi("r", SHAPE), vi("r_back", SHAPE), vi("yg_back", SHAPE), vi("s", FLAT), vi("d_f16", FLAT, T.FLOAT16)],
                       consts, opset=20)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def _run(model: ir.Model, feeds: dict, custom_ops: str | None) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CUDAExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def test_pointwise_on_cuda_equals_ort_cudas_ops_bit_for_bit(library: str) -> None:
    plain = _block()
    lowered = ir.from_proto(ir.to_proto(plain))
    assert fuse_pointwise(lowered) == 2
    assert not [n.op_type for n in lowered.graph if n.op_type in ("Add", "Mul", "Sum", "Div", "Sqrt", "Sub")]
    rng = np.random.default_rng(0)
    feeds = {n: (rng.standard_normal(SHAPE) * 41.7).astype(np.float32) for n in ("x", "y", "dx", "g")}
    want, got = _run(plain, feeds, None), _run(lowered, feeds, library)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name].view(np.uint8), value.view(np.uint8)), name
