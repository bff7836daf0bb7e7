"""The ``Pointwise`` CUDA kernel (``csrc/pointwise.cu``) against ORT CUDA's own elementwise ops.

A bf16 residual block's elementwise ops, natively in bfloat16 on ORT CUDA
(``benchmarks/pointwise_ab.block``): the float32 residual ``Add(x, Cast(y_bf16, float))``, its
bfloat16 copy for the next GEMM, a bias add and a product in bfloat16, the backward's
``Sum(g, Cast(dx_bf16, float))`` and a float32 chain with a Div and a Sqrt, with Reshapes
between them, on [8003, 768] tensors (so the kernel's four-element path and its tail both run). Lowered by the ``pointwise`` rule, every output must
equal the unlowered graph's bit for bit, NaN payloads aside (none are made here). Marked ``gpu``:
skipped without CUDA or onnxruntime-gpu. Run on a GPU machine with
``.venv/bin/python -m pytest -q -p no:randomly -n 0 -m gpu tests/test_gpu_pointwise.py``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from mpgraph.lowering.pointwise import fuse_pointwise
from tests.helpers import load_benchmark

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
ROWS = 8003  # a multiple of no block of 4 * 256 elements: the tail runs too
SHAPE = [ROWS, 768]


@pytest.fixture(scope="module")
def library() -> str:
    if not HAS_CUDA:
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    from mpgraph.lowering.plan import library as build

    return str(build("cuda"))


def _run(model: ir.Model, feeds: dict, custom_ops: str | None) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CUDAExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def test_pointwise_on_cuda_equals_ort_cudas_ops_bit_for_bit(library: str) -> None:
    plain = load_benchmark("pointwise_ab").block(ROWS)
    lowered = ir.from_proto(ir.to_proto(plain))
    assert fuse_pointwise(lowered) == 2
    assert not [n.op_type for n in lowered.graph if n.op_type in ("Add", "Mul", "Sum", "Div", "Sqrt", "Sub")]
    rng = np.random.default_rng(0)
    feeds = {n: (rng.standard_normal(SHAPE) * 41.7).astype(np.float32) for n in ("x", "y", "dx", "g")}
    want, got = _run(plain, feeds, None), _run(lowered, feeds, library)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name].view(np.uint8), value.view(np.uint8)), name
