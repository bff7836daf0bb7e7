"""The library's CUDA ``RotaryEmbedding`` (``csrc/rotary.cu``) against ORT CUDA's own, on ORT CUDA.

One node between Casts from float32 inputs (numpy has no bfloat16 to bind) and a Cast of Y
back, run as ORT's ``RotaryEmbedding`` and with the ``rotary`` rule applied: Llama's two forms
(bfloat16 ``[8, 1024, 12 * 64]`` and ``[8, 1024, 4 * 64]``, 3-D caches, no position ids, the
16-byte path), then every other form in float32, float16 and bfloat16 (4-D, interleaved,
position ids, partial rotary_embedding_dim, a half rotation of 20 that takes the one-element
path in float16 and bfloat16). The kernel rounds once per output (float, MLAS's fma), so it is
within half an ulp of T (plus float32 rounding) of the float64 rotation; ORT CUDA rounds each
step of its T arithmetic (x1 * cos, x2 * sin, their sum), so with the kernel's rounding the two
differ by at most six half-ulps of max |x| (|y| <= sqrt(2) max |x|, so y's half-ulp may be two):
3 ulps of T at max |x|. Marked ``gpu``: skipped without CUDA or
onnxruntime-gpu.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
#: One ulp of each type relative to the value (its machine epsilon).
EPS = {TensorProto.FLOAT: 2.0 ** -23, TensorProto.FLOAT16: 2.0 ** -10, TensorProto.BFLOAT16: 2.0 ** -7}


@pytest.fixture(scope="module")
def library() -> str:
    if not HAS_CUDA:
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    from mpgraph.lowering.plan import library as build

    return str(build("cuda"))


def _graph(dtype: int, b: int, s: int, n: int, h: int, *, rank: int = 3, interleaved: int = 0, rdim: int = 0,
           positions: bool = False, broadcast: bool = False, negate: bool = False) -> onnx.ModelProto:
    """``broadcast``: the caches are ``[1, S, half]`` expanded to the batch; ``negate``: sin
    negated (Llama's planned backward)."""
    f32 = TensorProto.FLOAT
    x_shape = [b, s, n * h] if rank == 3 else [b, n, s, h]
    cache = [s + 7, (rdim or h) // 2] if positions else [1 if broadcast else b, s, (rdim or h) // 2]
    inputs = [helper.make_tensor_value_info("x", f32, x_shape), helper.make_tensor_value_info("cos", f32, cache),
              helper.make_tensor_value_info("sin", f32, cache)]
    nodes = [helper.make_node("Cast", [name], [name + "_t"], to=dtype) for name in ("x", "cos", "sin")]
    args = ["x_t", "cos_t", "sin_t"]
    if broadcast:
        to = helper.make_tensor("to", TensorProto.INT64, [3], [b, s, (rdim or h) // 2])
        nodes += [helper.make_node("Constant", [], ["to"], value=to), helper.make_node("Expand", ["cos_t", "to"], ["cos_b"]),
                  helper.make_node("Expand", ["sin_t", "to"], ["sin_b"])]
        args = ["x_t", "cos_b", "sin_b"]
    if negate:
        nodes.append(helper.make_node("Neg", [args[2]], ["sin_n"]))
        args[2] = "sin_n"
    if positions:
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [b, s]))
        args.append("pos")
    attrs = {"interleaved": interleaved, **({"num_heads": n} if rank == 3 else {}),
             **({"rotary_embedding_dim": rdim} if rdim else {})}
    nodes += [helper.make_node("RotaryEmbedding", args, ["y_t"], name="rope", **attrs),
              helper.make_node("Cast", ["y_t"], ["y"], to=f32)]
    graph = helper.make_graph(nodes, "rope", inputs, [helper.make_tensor_value_info("y", f32, x_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)  # the rule reads X's rank, as a step graph records it


def _round(a: np.ndarray, dtype: int) -> np.ndarray:
    import ml_dtypes

    kind = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}
    return a.astype(kind[dtype]).astype(np.float32)


def _feeds(model: onnx.ModelProto, dtype: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "pos":
            feeds["pos"] = rng.integers(0, shape[1] + 7, size=shape).astype(np.int64)
        elif value.name == "x":
            feeds["x"] = _round(rng.standard_normal(shape).astype(np.float32) * 3, dtype)
        else:
            angle = rng.uniform(-np.pi, np.pi, size=shape)
            feeds[value.name] = _round((np.cos(angle) if value.name == "cos" else np.sin(angle)).astype(np.float32), dtype)
    return feeds


def _exact(feeds: dict[str, np.ndarray], rank: int, n: int, h: int, interleaved: int, rdim: int,
           negate: bool = False) -> np.ndarray:
    """The rotation in float64, laid out as X."""
    x = feeds["x"].astype(np.float64)
    b, s = (x.shape[0], x.shape[1]) if rank == 3 else (x.shape[0], x.shape[2])
    x = x.reshape(b, s, n, h) if rank == 3 else x.transpose(0, 2, 1, 3)
    cos, sin = feeds["cos"].astype(np.float64), feeds["sin"].astype(np.float64)
    if negate:
        sin = -sin
    if "pos" in feeds:
        cos, sin = cos[feeds["pos"]], sin[feeds["pos"]]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    r = rdim or h
    i1 = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    i2 = i1 + 1 if interleaved else i1 + r // 2
    y = x.copy()
    y[..., i1] = x[..., i1] * cos - x[..., i2] * sin
    y[..., i2] = x[..., i1] * sin + x[..., i2] * cos
    return y.reshape(feeds["x"].shape) if rank == 3 else y.transpose(0, 2, 1, 3)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], custom_ops: str | None) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    return session.run(None, feeds)[0]


CASES = [
    pytest.param(TensorProto.BFLOAT16, 8, 1024, 12, 64, {}, id="llama-q-bf16"),
    pytest.param(TensorProto.BFLOAT16, 8, 1024, 4, 64, {}, id="llama-k-bf16"),
    pytest.param(TensorProto.BFLOAT16, 8, 1024, 12, 64, {"broadcast": True, "negate": True}, id="llama-q-grad-bf16"),
    *[pytest.param(dtype, 2, 33, 3, h, form, id=f"{name}-{tag}")
      for dtype, tag in ((TensorProto.FLOAT, "f32"), (TensorProto.FLOAT16, "f16"), (TensorProto.BFLOAT16, "bf16"))
      for name, h, form in (("3d", 64, {}), ("4d-positions", 64, {"rank": 4, "positions": True}),
                            ("interleaved", 64, {"interleaved": 1}), ("partial", 64, {"rdim": 32, "positions": True}),
                            ("partial-interleaved-4d", 64, {"rank": 4, "interleaved": 1, "rdim": 48}),
                            ("one-element-path", 40, {}),
                            ("expand-neg-4d-interleaved", 64, {"rank": 4, "interleaved": 1, "broadcast": True,
                                                               "negate": True}),
                            ("expand-neg-one-element-path", 40, {"broadcast": True, "negate": True}))],
]


@pytest.mark.parametrize("dtype,b,s,n,h,form", CASES)
def test_kernel_against_ort_cuda_rotary_embedding(library: str, dtype, b, s, n, h, form) -> None:
    from mpgraph.lowering.rotary import fuse_rotary

    model = _graph(dtype, b, s, n, h, **form)
    lowered = ir.from_proto(model)
    assert fuse_rotary(lowered, "cuda") == 1
    feeds = _feeds(model, dtype, seed=b * s + h)
    want = _run(model, feeds, None)
    got = _run(ir.to_proto(lowered), feeds, library)
    exact = _exact(feeds, form.get("rank", 3), n, h, form.get("interleaved", 0), form.get("rdim", 0),
                   form.get("negate", False))
    if form.get("broadcast"):  # the Expand and Neg are read through and gone
        assert not [node for node in lowered.graph if node.op_type in ("Expand", "Neg")]
    eps, big = EPS[dtype], np.abs(feeds["x"]).max()
    # One rounding to T: half an ulp of |y|, plus float32's roundings of the terms (|y| <= 2 max|x|).
    np.testing.assert_allclose(got, exact, rtol=eps / 2, atol=4 * 2.0 ** -24 * big)
    np.testing.assert_allclose(got, want, rtol=0, atol=3 * eps * big)


def test_llama_block_bf16_step_with_and_without_the_rule(library: str, monkeypatch) -> None:
    """``test_lowering_sdpa_layout``'s Llama-form block (GQA, Q and K rotated, fused attention):
    its bf16 AdamW step planned for CUDA with every default rule, and again with
    ``MPGRAPH_ROTARY=ort`` (ORT's RotaryEmbedding, the graph's Neg). The rule takes the four
    rotaries (Q, K and their gradients: 3-D after ``sdpa_layout`` where the library has cuDNN's
attention, 4-D around the expanded attention otherwise; planned here without cuDNN: 4 of 4,
two with ``negate_sin``); the outputs agree within the
    bfloat16 roundings the kernel saves (5e-2 of max, as test_gpu_sdpa: AdamW's first update is
    about lr * sign(g), which a one-ulp change of a near-zero gradient may flip)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_lowering_sdpa_layout import _rotary_block

    from mpgraph import convert
    from mpgraph.lowering.plan import PlanOptions, plan_session
    from mpgraph.training import build_training_graph
    from tests.helpers import assert_outputs_close, step_feeds

    step = convert(build_training_graph(_rotary_block(), optimizer="adamw", lr=1e-2, target="cuda"), "bf16")
    fused = plan_session(step, "cuda", PlanOptions(kernels=True))
    monkeypatch.setenv("MPGRAPH_ROTARY", "ort")
    plain = plan_session(step, "cuda", PlanOptions(kernels=True))
    assert dict(fused.applied)["rotary"] == 4 and dict(plain.applied)["rotary"] == 0
    x = np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)
    results = []
    for plan in (fused, plain):
        model = onnx.load_from_string(plan.graph)
        results.append(dict(zip([o.name for o in model.graph.output], _run_all(plan, step_feeds(model, x)), strict=True)))
    assert_outputs_close(results[0], results[1], 5e-2)


def _run_all(plan, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if plan.custom_ops:
        options.register_custom_ops_library(plan.custom_ops)
    session = ort.InferenceSession(plan.graph, options, providers=["CUDAExecutionProvider"])
    return session.run(None, feeds)
