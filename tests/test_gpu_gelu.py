"""The fused GELU backwards on CUDA (``csrc/gelu.cu``) against the ops they replace, on ORT CUDA.

``TanhGeluGrad`` (``Gelu(approximate="tanh")``, GPT-2's ``gelu_new``) and ``ErfGeluGrad`` in
bfloat16: a step graph of ``Gelu(x) * dy`` with bfloat16 inputs, so the gradient rule's ops run
in bfloat16 as in a bf16 step, planned with the ``gelu`` rule and without it; dx elementwise.
Both kernels round every step to bfloat16 as ORT's ops do, so they may differ only where a
tanh (erf, exp) rounds differently, by at most what one bfloat16 ulp of that value moves dx.
Then a whole bf16 AdamW step of a GPT-2-style MLP block, fused against plain. Marked ``gpu``:
skipped without CUDA or onnxruntime-gpu.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers import assert_outputs_close, step_feeds

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
N = 1 << 16
EPS = 2.0 ** -7  # one bfloat16 ulp relative to its value, at most


@pytest.fixture(scope="module")
def library() -> str:
    if not HAS_CUDA:
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    from mpgraph.lowering.plan import library as build

    return str(build("cuda"))


def _session(graph: bytes, custom_ops: str | None):
    options = ort.SessionOptions()
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    return ort.InferenceSession(graph, options, providers=["CUDAExecutionProvider"])


def _gelu_step(approximate: str):
    """``loss = sum(float(Gelu(bf16(x)) * bf16(dy)))`` with x trainable: the Gelu's dx for that
    dy (the loss's ones times dy, exact) computed in bfloat16 by its gradient rule's ops, read
    back as ``grad/x`` in float32 (ORT's Python API takes and gives no bfloat16 arrays)."""
    import onnx_ir as ir

    from mpgraph.training import build_training_graph

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=bf16), helper.make_node("Cast", ["dy"], ["dyb"], to=bf16),
             helper.make_node("Gelu", ["xb"], ["y"], approximate=approximate),
             helper.make_node("Mul", ["y", "dyb"], ["z"]), helper.make_node("Cast", ["z"], ["z32"], to=f32),
             helper.make_node("ReduceSum", ["z32"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", f32, [N]),
                                              helper.make_tensor_value_info("dy", f32, [N])],
                              [helper.make_tensor_value_info("loss", f32, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return build_training_graph(ir.from_proto(model), optimizer=None, params=[], trainable_inputs=["x"],
                                target="cuda")


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even), as float32: the graph's Casts keep them."""
    import ml_dtypes

    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _bound(x: np.ndarray, dy: np.ndarray, approximate: str) -> np.ndarray:
    """How far dx may move when a transcendental's bfloat16 result moves one ulp, plus a few
    ulps of rounding in each step after it (the rule's terms, in float64, generously)."""
    if approximate == "tanh":
        c, k = np.sqrt(2 / np.pi), 0.044715
        t = np.tanh(x * (c + k * c * x * x))
        dinner = c + 3 * k * c * x * x
        slope = 0.5 + np.abs(x * t) * dinner  # |d dx / d t| / |dy|
        size = 1 + 0.5 * np.abs(x) * dinner  # |half (1 + t)| + |half x sech2 dinner| (sech2 <= 1), over |dy|
    else:
        slope, size = 1.0, 2.0  # erf moves cdf by half its change, exp moves s / exp(s^2) <= 0.43 in ratio
    return 4 * EPS * np.abs(dy) * (slope + size)


@pytest.mark.parametrize("approximate,op", [("tanh", "TanhGeluGrad"), ("none", "ErfGeluGrad")])
def test_fused_gelu_backward_matches_the_unfused_bf16_ops(library: str, approximate: str, op: str) -> None:
    from mpgraph.lowering.plan import PlanOptions, plan_session

    step = _gelu_step(approximate)
    fused = plan_session(step, "cuda", PlanOptions(scope="all"))
    plain = plan_session(step, "cuda", PlanOptions(kernels=False))
    assert dict(fused.applied)["gelu"] == 1
    ops = [n.op_type for n in onnx.load_from_string(fused.graph).graph.node]
    assert op in ops and "Tanh" not in ops and "Erf" not in ops
    rng = np.random.default_rng(0)
    x32 = np.concatenate([np.linspace(-10, 10, N // 2, dtype=np.float32),
                          3 * rng.standard_normal(N // 2).astype(np.float32)])
    feeds = {"x": _bf16(x32), "dy": _bf16(rng.standard_normal(N).astype(np.float32))}
    got = _session(fused.graph, fused.custom_ops).run(["grad/x"], feeds)[0]
    want = _session(plain.graph, None).run(["grad/x"], feeds)[0]
    assert np.array_equal(_bf16(want), want)  # bfloat16 values: the rule's ops did run in bfloat16
    x, dy = feeds["x"].astype(np.float64), feeds["dy"].astype(np.float64)
    diff = np.abs(got.astype(np.float64) - want)
    same = float(np.mean(got == want))
    assert np.all(diff <= _bound(x, dy, approximate)), (op, float(diff.max()), same)
    assert same > 0.75, (op, same)  # a stray ulp where a tanh (erf, exp) rounds apart, not another formula


def test_lowered_bf16_mlp_step_matches_the_unfused_step(library: str) -> None:
    """The MLP block of test_lowering_tanh_gelu (matmul, bias, tanh GELU, matmul): its bf16
    AdamW step on ORT CUDA with every kernel rule against the same step with none."""
    from mpgraph.lowering.plan import PlanOptions, plan_session
    from tests.test_lowering_tanh_gelu import _bf16_step

    step = _bf16_step()
    fused = plan_session(step, "cuda", PlanOptions(scope="all"))
    assert dict(fused.applied)["gelu"] == 1
    plain = plan_session(step, "cuda", PlanOptions(kernels=False))
    results = []
    for plan in (fused, plain):
        session = _session(plan.graph, plan.custom_ops)
        feeds = step_feeds(onnx.load_from_string(plan.graph))
        results.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)))
    assert_outputs_close(results[0], results[1], 5e-2)

