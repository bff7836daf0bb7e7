"""``GemmBias`` on CUDA (``csrc/gemm_bias.cu``: one cuBLASLt matmul with the bias epilogue)
against ORT CUDA's own ``Gemm`` (bias broadcast into Y, then the GEMM with beta = 1).

float16 and bfloat16, every transA/transB, alpha, a [1, N] bias, GPT-2 small's four linear
shapes at 1024 rows and odd sizes (leading dimensions no multiple of 8: where cuBLASLt has no
bias-epilogue algorithm the op broadcasts the bias itself first, ORT's own arithmetic, judged
as ORT's Gemm is; the CUDA rule leaves such Gemms to ORT); ``matmul_bias`` on a 3-D
linear layer; the opt-in ``GemmBiasGelu``. GemmBias accumulates in float32, adds the bias in
float32 and rounds once, so each case's reference is the float64 result of the rounded inputs,
rounded once: within one ulp of the element type plus float32's summation bound
(``tests/test_lowering_gemm_bias.py`` says why). ORT CUDA's own bfloat16 ``Gemm`` is not that
reference: on the H200 it lands up to 7 ulps from it where the product and the bias cancel
(benchmarks/results/gpu_tests_2026-12-03T05.log), as if the product were rounded before the
bias is added; its results are compared only within that looser bound. Then a lowered bf16
step whose linear layers are GemmBias against the same step unlowered.
Marked ``gpu``: skipped without CUDA or onnxruntime-gpu, or with a library built without
cuBLASLt (``build.cublaslt_flags`` says why).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T

from tests.helpers import cublaslt_cuda_library
from tests.test_lowering_gemm_bias import ULP_BITS, _linear_block, _low

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module")
def library() -> str:
    return cublaslt_cuda_library("the library has no CUDA GemmBias")


def _run(model: ir.Model, feeds: dict[str, np.ndarray], custom_ops: str | None) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CUDAExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def _graph(dtype: int, m: int, k: int, n: int, trans_a: int, trans_b: int, alpha: float,
           bias_shape: tuple[int, ...]) -> ir.Model:
    import onnx
    from onnx import helper as h

    nodes = [h.make_node("Cast", [x], [f"{x}_low"], to=dtype) for x in "abc"]
    nodes += [h.make_node("Gemm", ["a_low", "b_low", "c_low"], ["g"], transA=trans_a, transB=trans_b, alpha=alpha),
              h.make_node("Cast", ["g"], ["y"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "gemm", [h.make_tensor_value_info("a", T.FLOAT, (k, m) if trans_a else (m, k)),
                                         h.make_tensor_value_info("b", T.FLOAT, (n, k) if trans_b else (k, n)),
                                         h.make_tensor_value_info("c", T.FLOAT, bias_shape)],
                         [h.make_tensor_value_info("y", T.FLOAT, [m, n])])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


SHAPES = [(1024, 768, 2304), (1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768), (37, 21, 50), (1, 8, 16)]


@pytest.mark.parametrize("dtype", [T.BFLOAT16, T.FLOAT16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize(("trans_a", "trans_b", "alpha", "bias_shape"),
                         [(0, 0, 1.0, "n"), (1, 0, 0.5, "n"), (0, 1, 1.0, "1n"), (1, 1, 2.0, "n")])
def test_cuda_gemm_bias_matches_ort_cuda_gemm(library, dtype, m, k, n, trans_a, trans_b, alpha, bias_shape):
    from mpgraph.lowering.gemm_bias import fuse_gemm_bias

    shape_c = (n,) if bias_shape == "n" else (1, n)
    rng = np.random.default_rng(m + k + n)
    feeds = {"a": rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32),
             "b": (rng.standard_normal((n, k) if trans_b else (k, n)) / np.sqrt(k)).astype(np.float32),
             "c": rng.standard_normal(shape_c).astype(np.float32)}
    plain = _graph(dtype, m, k, n, trans_a, trans_b, alpha, shape_c)
    ort_gemm = _run(plain, feeds, None)["y"]
    aligned = all(d % 8 == 0 for d in (m if trans_a else k, k if trans_b else n, n))  # A's, B's and Y's leading dims
    assert fuse_gemm_bias(_graph(dtype, m, k, n, trans_a, trans_b, alpha, shape_c), aligned_only=True) == int(aligned)
    fused = _graph(dtype, m, k, n, trans_a, trans_b, alpha, shape_c)
    assert fuse_gemm_bias(fused) == 1  # the op itself on every shape, its fallback too
    got = _run(fused, feeds, library)["y"]
    a = _low(feeds["a"], dtype).astype(np.float64)
    b = _low(feeds["b"], dtype).astype(np.float64)
    a, b = (a.T if trans_a else a), (b.T if trans_b else b)
    product = alpha * (a @ b)
    want = _low((product + _low(feeds["c"], dtype).reshape(1, n)).astype(np.float32), dtype)
    sums = k * 2.0 ** -23 * abs(alpha) * (np.abs(a) @ np.abs(b))
    assert np.array_equal(got, _low(got, dtype))
    bound = _ulp(want, dtype) + sums
    # ORT's Gemm, within a second rounding (of the product) of the same reference; so the op's
    # fallback where a leading dimension is unaligned (ORT's arithmetic: broadcast, beta = 1),
    # which the CUDA rule does not take.
    second = bound + _ulp(product, dtype)
    mine = bound if aligned else second
    assert np.all(np.abs(got - want) <= mine), float(np.max(np.abs(got - want) / mine))
    assert np.all(np.abs(ort_gemm - want) <= second)


def _ulp(v: np.ndarray, dtype: int) -> np.ndarray:
    """One ulp of ``dtype`` at ``v`` (float16's subnormal step below its smallest normal)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -14))) - ULP_BITS[dtype])


@pytest.mark.parametrize("gelu", [False, True])
def test_bf16_step_with_gemm_bias_matches_unlowered(library, monkeypatch, gelu):
    """A bf16 AdamW step of a GELU MLP in Gemm form: with its two forward Gemms as GemmBias
    (``gelu``: the first, read by the tanh Gelu, as GemmBiasGelu), loss and updated parameters
    as the unlowered step's, within bfloat16 rounding of the forward (one ulp of each Gemm's
    output moves the rest)."""
    from mpgraph.convert import convert
    from mpgraph.lowering.gemm_bias import fuse_gemm_bias, fuse_gemm_bias_gelu
    from mpgraph.training import build_training_graph
    from tests.helpers import step_feeds

    if gelu:
        monkeypatch.setenv("MPGRAPH_GEMM_GELU", "1")
    else:
        monkeypatch.delenv("MPGRAPH_GEMM_GELU", raising=False)
    grads = build_training_graph(_linear_block(), optimizer="adamw", params=["w", "b", "v", "u"], target="cuda")
    step = convert(grads, "bf16", validate=False, calibrate=None, target="cuda")
    feeds = step_feeds(ir.to_proto(step))
    want = _run(step, feeds, None)
    fused = ir.from_proto(ir.to_proto(step))
    assert fuse_gemm_bias(fused) == 2 and fuse_gemm_bias_gelu(fused) == int(gelu)
    got = _run(fused, feeds, library)
    assert set(got) == set(want)
    for name, value in want.items():
        scale = max(float(np.max(np.abs(value))), 1e-6) if value.size else 1.0
        np.testing.assert_allclose(got[name], value, rtol=0, atol=2.0 ** -6 * scale, err_msg=name)


@pytest.mark.parametrize("dtype", [T.BFLOAT16, T.FLOAT16])
@pytest.mark.parametrize(("fused", "trans_b", "alpha"), [(False, 0, 1.0), (True, 1, 0.5)])
def test_cuda_matmul_bias_matches_float64_rounded_once(library, dtype, fused, trans_b, alpha):
    """``matmul_bias`` on a [8, 128, 768] x [768, 3072] linear layer (ViT-B's fc1 at 8 x 128
    tokens): GemmBias rounds the sum once, so its reference is the float64 sum of the rounded
    inputs rounded once (the graph's MatMul + Add round twice)."""
    import onnx
    from onnx import helper as h

    from mpgraph.lowering.gemm_bias import fuse_matmul_bias

    lead, k, n = (8, 128), 768, 3072
    nodes = [h.make_node("Cast", [x], [f"{x}_low"], to=dtype) for x in "abc"]
    nodes.append(h.make_node("FusedMatMul", ["a_low", "b_low"], ["p"], domain="com.microsoft", transB=trans_b, alpha=alpha)
                 if fused else h.make_node("MatMul", ["a_low", "b_low"], ["p"]))
    nodes += [h.make_node("Add", ["p", "c_low"], ["s"]), h.make_node("Cast", ["s"], ["y"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "linear", [h.make_tensor_value_info("a", T.FLOAT, [*lead, k]),
                                           h.make_tensor_value_info("b", T.FLOAT, (n, k) if trans_b else (k, n)),
                                           h.make_tensor_value_info("c", T.FLOAT, [n])],
                         [h.make_tensor_value_info("y", T.FLOAT, [*lead, n])],
                         value_info=[h.make_tensor_value_info("p", dtype, [*lead, n])])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(
        h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)], ir_version=10)))
    assert fuse_matmul_bias(model) == 1
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal((*lead, k)).astype(np.float32),
             "b": (rng.standard_normal((n, k) if trans_b else (k, n)) / np.sqrt(k)).astype(np.float32),
             "c": rng.standard_normal(n).astype(np.float32)}
    got = _run(model, feeds, library)["y"]
    a = _low(feeds["a"], dtype).astype(np.float64).reshape(-1, k)
    b = _low(feeds["b"], dtype).astype(np.float64)
    exact = alpha * (a @ (b.T if trans_b else b)) + _low(feeds["c"], dtype)
    want = _low(exact.astype(np.float32), dtype).reshape(got.shape)
    exponent = np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -14)))
    bound = 2.0 ** (exponent - ULP_BITS[dtype]) + (k * 2.0 ** -23 * abs(alpha) * (np.abs(a) @ np.abs(b.T if trans_b else b))
                                                    ).reshape(got.shape)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@pytest.mark.parametrize("dtype", [T.BFLOAT16, T.FLOAT16])
@pytest.mark.parametrize(("m", "k", "n"), [
    (1024, 768, 3072),
    pytest.param(37, 21, 50, marks=pytest.mark.xfail(strict=True, reason=(
        "the CUDA op's unaligned path (GemmBias into the aux, then the GELU kernel) landed 60 bounds "
        "off on the H200 at 0cc756a in both types; the CUDA rule takes only aligned linears"))),
])
def test_cuda_gemm_bias_gelu_matches_ort_gemm_and_gelu(library, monkeypatch, dtype, m, k, n):
    """GemmBiasGelu (GPT-2 small's fc at 1024 rows: cuBLASLt's GELU_AUX_BIAS; N = 50, no
    multiple of 8: GemmBias into the aux, then the GELU kernel) against ORT CUDA's Gemm and
    Gelu(approximate="tanh"), both judged against float64: the GELU's input (the aux) within
    one ulp of the float64 sum rounded once, plus float32's summation bound; the GELU within
    two ulps of the float64 tanh GELU of the float64 sum plus GELU' (at most 1.13) times the
    summation bound (the epilogue applies GELU to the float32 sum, rounding once; the second
    ulp is its tanh's own error). ORT's Gemm and Gelu round the sum first: within one more
    ulp of the sum, times GELU', of the same references."""
    import onnx
    from onnx import helper as h

    from mpgraph.lowering.gemm_bias import fuse_gemm_bias, fuse_gemm_bias_gelu

    monkeypatch.setenv("MPGRAPH_GEMM_GELU", "1")
    nodes = [h.make_node("Cast", [x], [f"{x}_low"], to=dtype) for x in "abc"]
    nodes += [h.make_node("Gemm", ["a_low", "b_low", "c_low"], ["p"]), h.make_node("Gelu", ["p"], ["g"], approximate="tanh"),
              h.make_node("Cast", ["g"], ["g32"], to=T.FLOAT), h.make_node("Cast", ["p"], ["p32"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "fc", [h.make_tensor_value_info("a", T.FLOAT, (m, k)), h.make_tensor_value_info("b", T.FLOAT, (k, n)),
                                       h.make_tensor_value_info("c", T.FLOAT, (n,))],
                         [h.make_tensor_value_info("g32", T.FLOAT, [m, n]), h.make_tensor_value_info("p32", T.FLOAT, [m, n])])
    plain = ir.from_proto(onnx.shape_inference.infer_shapes(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)))
    fused = ir.from_proto(ir.to_proto(plain))
    assert fuse_gemm_bias(fused) == 1 and fuse_gemm_bias_gelu(fused) == 1
    rng = np.random.default_rng(m + n)
    feeds = {"a": rng.standard_normal((m, k)).astype(np.float32),
             "b": (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), "c": rng.standard_normal(n).astype(np.float32)}
    ort_out, got = _run(plain, feeds, None), _run(fused, feeds, library)
    a, b = _low(feeds["a"], dtype).astype(np.float64), _low(feeds["b"], dtype).astype(np.float64)
    exact = a @ b + _low(feeds["c"], dtype)
    gelu = 0.5 * exact * (1 + np.tanh(np.sqrt(2 / np.pi) * (exact + 0.044715 * exact ** 3)))
    want_p, want_g = _low(exact.astype(np.float32), dtype), _low(gelu.astype(np.float32), dtype)
    sums = k * 2.0 ** -23 * (np.abs(a) @ np.abs(b))
    bound_p = _ulp(want_p, dtype) + sums
    assert np.all(np.abs(got["p32"] - want_p) <= bound_p), float(np.max(np.abs(got["p32"] - want_p) / bound_p))
    bound_g = 2 * _ulp(want_g, dtype) + 1.13 * sums
    assert np.all(np.abs(got["g32"] - want_g) <= bound_g), float(np.max(np.abs(got["g32"] - want_g) / bound_g))
    assert np.all(np.abs(ort_out["p32"] - want_p) <= bound_p + _ulp(a @ b, dtype))
    assert np.all(np.abs(ort_out["g32"] - want_g) <= bound_g + 1.13 * (bound_p + _ulp(a @ b, dtype)))
