"""``sdpa_layout`` on ORT CUDA: the 3-D ``RotaryEmbedding`` it writes for Llama's Q and K.

The rule moves a rotary from ``[B, H, S, D]`` (after the exporter's reshape and transpose) to
the ``[B, S, H * D]`` projection, in ONNX's ``num_heads`` form. ORT CUDA must compute the same
bfloat16 values either way: the 4-D chain (reshape, transpose, rotary, transpose back, reshape)
against the 3-D rotary, equal bit for bit. Marked ``gpu``: skipped without onnxruntime-gpu.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
B, S, H, D = 2, 64, 4, 64


def _model(three_d: bool) -> bytes:
    n = helper.make_node
    bf16 = [n("Cast", ["x32"], ["x"], to=TensorProto.BFLOAT16)]  # float32 in and out, bfloat16 inside
    if three_d:
        nodes = [n("RotaryEmbedding", ["x", "cos", "sin"], ["y"], num_heads=H)]
    else:
        nodes = [n("Reshape", ["x", "heads"], ["xs"]), n("Transpose", ["xs"], ["x4"], perm=[0, 2, 1, 3]),
                 n("RotaryEmbedding", ["x4", "cos", "sin"], ["y4"], num_heads=H),
                 n("Transpose", ["y4"], ["ys"], perm=[0, 2, 1, 3]), n("Reshape", ["ys", "flat"], ["y"])]
    nodes = bf16 + nodes + [n("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    angle = np.arange(S)[:, None] / 10000 ** (np.arange(D // 2) / (D // 2))
    inits = [numpy_helper.from_array(np.array([B, S, H, D], np.int64), "heads"),
             numpy_helper.from_array(np.array([B, S, H * D], np.int64), "flat")]
    for name, f in (("cos", np.cos), ("sin", np.sin)):
        table = helper.make_tensor(name, TensorProto.BFLOAT16, [B, S, D // 2],
                                   np.broadcast_to(f(angle), (B, S, D // 2)).astype(np.float32).ravel().tolist())
        inits.append(table)
    graph = helper.make_graph(nodes, "rotary", [helper.make_tensor_value_info("x32", TensorProto.FLOAT, [B, S, H * D])],
                              [helper.make_tensor_value_info("y32", TensorProto.FLOAT, [B, S, H * D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    return model.SerializeToString()


@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu's CUDAExecutionProvider")
def test_3d_rotary_equals_the_4d_chain_on_cuda() -> None:
    x = np.random.default_rng(0).standard_normal((B, S, H * D)).astype(np.float32)
    outs = []
    for three_d in (False, True):
        session = ort.InferenceSession(_model(three_d), providers=["CUDAExecutionProvider"])
        assert session.get_providers()[0] == "CUDAExecutionProvider"
        outs.append(session.run(None, {"x32": x})[0])
    assert np.array_equal(outs[0], outs[1])
    assert not np.allclose(outs[1], x, atol=1e-2)  # the rotary did rotate
