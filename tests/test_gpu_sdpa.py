"""The fused attention ops on CUDA (cuDNN's SDPA through ``csrc/sdpa.cu``) against torch.

``SdpaForward``/``SdpaBackward`` in bfloat16 and float16, 4-D and 3-D (GQA) layouts, causal and
not, against a float64 reference computed by torch from the same rounded inputs; then a whole
bf16 step graph lowered with the ``sdpa`` rule against the same step without it. Marked ``gpu``:
skipped without CUDA, onnxruntime-gpu, or a kernel library built with cuDNN.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers import assert_outputs_close, step_feeds

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


@pytest.fixture(scope="module")
def library() -> str:
    if not HAS_CUDA:
        pytest.skip("needs CUDAExecutionProvider and torch CUDA")
    from mpgraph.lowering.plan import has_sdpa
    from mpgraph.lowering.plan import library as build

    path = str(build("cuda"))
    if not has_sdpa(path):
        pytest.skip("the kernel library was built without cuDNN's SDPA")
    return path


def _model(layout: str, hq: int, hkv: int, causal: int, scale: float, elem: int) -> bytes:
    """Q, K, V, dY in float32 -> cast -> SdpaForward -> SdpaBackward -> Y, dQ, dK, dV in float32."""
    n = helper.make_node
    attrs = {"scale": scale, "is_causal": causal, "q_num_heads": hq, "kv_num_heads": hkv}
    nodes = [n("Cast", [x], [f"{x}_low"], to=elem) for x in ("q", "k", "v", "dy")]
    nodes += [
        n("SdpaForward", ["q_low", "k_low", "v_low"], ["y_low", "stats"], domain="ai.mpgraph", **attrs),
        n("SdpaBackward", ["q_low", "k_low", "v_low", "y_low", "dy_low", "stats"], ["dq_low", "dk_low", "dv_low"],
          domain="ai.mpgraph", **attrs),
    ]
    nodes += [n("Cast", [f"{x}_low"], [x], to=TensorProto.FLOAT) for x in ("y", "dq", "dk", "dv")]
    graph = helper.make_graph(
        nodes, "sdpa", [helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in ("q", "k", "v", "dy")],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in ("y", "dq", "dk", "dv")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def _reference(q, k, v, dy, hq, hkv, causal, scale):
    """float64 torch attention in [B, H, S, D] with GQA by repeating K and V."""
    t = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v)]
    rep = hq // hkv
    kk, vv = (x.repeat_interleave(rep, dim=1) for x in t[1:])
    scores = (t[0] @ kk.transpose(-1, -2)) * scale
    if causal:
        s, kv = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(s, kv, dtype=torch.bool).triu(1), -math.inf)
    y = torch.softmax(scores, -1) @ vv
    y.backward(torch.tensor(dy, dtype=torch.float64))
    return [y.detach().numpy()] + [x.grad.numpy() for x in t]


@pytest.mark.parametrize("layout,hq,hkv,causal,elem", [
    ("4d", 4, 4, 1, TensorProto.BFLOAT16),
    ("4d", 4, 4, 0, TensorProto.FLOAT16),
    ("3d", 8, 2, 1, TensorProto.BFLOAT16),
])
def test_fused_attention_matches_float64_torch(library: str, layout: str, hq: int, hkv: int, causal: int,
                                               elem: int) -> None:
    b, s, d = 2, 128, 64
    scale = 1.0 / math.sqrt(d)
    rng = np.random.default_rng(0)
    low = torch.bfloat16 if elem == TensorProto.BFLOAT16 else torch.float16
    rounded = lambda a: torch.tensor(a).to(low).float().numpy()  # noqa: E731
    q4, k4, v4, dy4 = (rounded(rng.standard_normal((b, h, s, d)).astype(np.float32)) for h in (hq, hkv, hkv, hq))
    to3 = lambda a: a.transpose(0, 2, 1, 3).reshape(b, s, -1).copy()  # noqa: E731
    feeds = {"q": q4, "k": k4, "v": v4, "dy": dy4} if layout == "4d" else {
        "q": to3(q4), "k": to3(k4), "v": to3(v4), "dy": to3(dy4)}
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(_model(layout, hq, hkv, causal, scale, elem), options,
                                   providers=["CUDAExecutionProvider"])
    got = session.run(["y", "dq", "dk", "dv"], feeds)
    want = _reference(q4, k4, v4, dy4, hq, hkv, causal, scale)
    for name, g, w in zip(("y", "dq", "dk", "dv"), got, want, strict=True):
        w = w if layout == "4d" else to3(w)
        err = float(np.abs(g - w).max() / np.abs(w).max())
        assert err < 2e-2, (name, err)


def test_lowered_bf16_step_matches_the_unfused_step(library: str) -> None:
    """The attention block of test_lowering_attention (GQA 2:1, head dim 8, causal, 3-D): its
    bf16 AdamW step on ORT CUDA with the sdpa rule against the same step with no kernel rule."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_lowering_attention import B, D, T, _block

    from mpgraph import convert
    from mpgraph.lowering.plan import PlanOptions, plan_session
    from mpgraph.training import build_training_graph

    step = convert(build_training_graph(_block((2, 1)), optimizer="adamw", target="cuda"), "bf16")
    fused = plan_session(step, "cuda", PlanOptions(kernels=True))
    assert dict(fused.applied).get("sdpa") == 1, fused.applied
    plain = plan_session(step, "cuda", PlanOptions(kernels=False))
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    results = []
    for plan in (fused, plain):
        options = ort.SessionOptions()
        if plan.custom_ops:
            options.register_custom_ops_library(plan.custom_ops)
        session = ort.InferenceSession(plan.graph, options, providers=["CUDAExecutionProvider"])
        model = onnx.load_from_string(plan.graph)
        feeds = step_feeds(model, x)
        results.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)))
    ops = {n.op_type for n in onnx.load_from_string(fused.graph).graph.node}
    assert {"SdpaForward", "SdpaBackward"} <= ops
    assert_outputs_close(results[0], results[1], 5e-2)

