"""``GemmFp8`` on CUDA (``csrc/gemm_fp8.cu``: one cuBLASLt fp8 matmul, handle, workspace and
plans kept): against numpy, against ORT's own ``GemmFloat8``, inside a captured CUDA graph, and
an fp8 training step captured whole (what ``GemmFloat8``, which allocates per call, prevents);
and ``Fp8Transpose`` (the byte transpose of the transposed operands), ``AbsMax`` (the amax of
a quantised tensor in one read) and ``CastToFloat8*`` (scale and quantise in one pass) against
numpy or the CPU kernels.

The three format pairs the lowering writes, into bf16, on GPT-2 small's linear shapes at 1024
rows and the bench GPT's at 8192. E4M3 x E4M3 runs with fast accumulation (as ORT's GemmFloat8
does for every pair), so the sums are not float32's: the bound is 1% of max |Y| against float64
numpy on the same fp8 values (``benchmarks/fp8_step.py``'s probe of GemmFloat8 measured at most
0.19%). E4M3 x E4M3 (fast accumulation on both sides) is at most one bf16 rounding step apart
from GemmFloat8's float32 result; a mixed pair, whose sums GemmFp8 promotes to float32 and
GemmFloat8 does not, is on average at least as close to numpy as GemmFloat8 rounded to bf16
(with the same fast accumulation, 1-3% of the elements differed by more than a bf16 step, H200,
2026-12-03).
Marked ``gpu``: skipped without CUDA or onnxruntime-gpu, or with a library built without
cuBLASLt (``build.cublaslt_flags`` says why).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T

from tests.helpers import cublaslt_cuda_library
from tests.test_lowering_fp8 import _gemm_fp8_graph, _gpt_step, gemm_fp8_reference

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

E4M3, E5M2 = ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


@pytest.fixture(scope="module")
def library() -> str:
    return cublaslt_cuda_library("the library has no cuBLASLt (GemmBias, GemmFp8)")


def _session(model: bytes, custom_ops: str | None, graph: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if graph else {})
    return ort.InferenceSession(model, options, providers=[provider])


def _cuda_equals_cpu(model: bytes, library: str, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """``model`` on CUDA with ``library`` and on the CPU with the library's CPU kernels, for each of
    ``feeds``: every output the same shape and values, NaN where NaN. Returns the CUDA outputs of
    the last feeds."""
    from mpgraph import lowering as kernels

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernels.library("cpu")))
    cpu = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    cuda = _session(model, library)
    got: list[np.ndarray] = []
    for f in feeds:
        got, want = cuda.run(None, f), cpu.run(None, f)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.array_equal(np.isnan(g), np.isnan(w))
            np.testing.assert_array_equal(g[~np.isnan(g)], w[~np.isnan(w)])
    return got


def _feeds(m: int, n: int, k: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(m + n + k)
    return {"A": rng.standard_normal((m, k)).astype(np.float32) * 4, "B": rng.standard_normal((n, k)).astype(np.float32),
            "sa": np.array(0.25, np.float32), "sb": np.array(2.0, np.float32)}


def _gemm_float8_graph(fa: ir.DataType, fb: ir.DataType, m: int, n: int, k: int) -> bytes:
    """ORT's GemmFloat8 on the same operands, into what the lowering writes it with
    (``gemm_dtype``: bf16 for E4M3 x E4M3, float32 for a mixed pair), then float32."""
    from onnx import helper as h

    from mpgraph.lowering.fp8_gemm import gemm_dtype

    dtype = gemm_dtype(fa, fb, ir.DataType.BFLOAT16).value

    nodes = [h.make_node("Cast", ["A"], ["qa"], to=fa.value, saturate=1), h.make_node("Cast", ["B"], ["qb"], to=fb.value, saturate=1),
             h.make_node("GemmFloat8", ["qa", "qb", "", "sa", "sb"], ["Yg"], domain="com.microsoft", transA=0, transB=1,
                         alpha=0.5, dtype=dtype), h.make_node("Cast", ["Yg"], ["Y"], to=T.FLOAT)]
    inputs = [h.make_tensor_value_info("A", T.FLOAT, [m, k]), h.make_tensor_value_info("B", T.FLOAT, [n, k]),
              h.make_tensor_value_info("sa", T.FLOAT, []), h.make_tensor_value_info("sb", T.FLOAT, [])]
    graph = h.make_graph(nodes, "gemm_float8", inputs, [h.make_tensor_value_info("Y", T.FLOAT, [m, n])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


@pytest.mark.parametrize(("fa", "fb"), PAIRS)
@pytest.mark.parametrize(("m", "n", "k"), [(1024, 2304, 768), (1024, 768, 3072), (8192, 2048, 2048), (48, 32, 16)])
def test_cuda_gemm_fp8_matches_numpy_and_gemm_float8(library, fa, fb, m, n, k) -> None:
    feeds = _feeds(m, n, k)
    got = _session(_gemm_fp8_graph(fa, fb, m, n, k, alpha=0.5), library).run(None, feeds)[0]
    want = gemm_fp8_reference(feeds["A"], feeds["B"], fa, fb, 0.25, 2.0, 0.5)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    theirs = _session(_gemm_float8_graph(fa, fb, m, n, k), None).run(None, feeds)[0]
    theirs_bf16 = theirs.astype(ml_dtypes.bfloat16).astype(np.float32)
    if fa == fb:  # both with fast accumulation: the same sums, up to one bf16 rounding
        step = np.abs(theirs_bf16) * 2.0**-7 + 1e-30  # one bf16 rounding step at that magnitude
        assert (np.abs(got - theirs_bf16) <= step * 1.01).mean() > 0.99
    else:  # GemmFp8 promotes a gradient product's sums to float32, GemmFloat8 accumulates fast
        assert np.abs(got - want).mean() <= np.abs(theirs_bf16 - want).mean()


@pytest.mark.parametrize(("fa", "fb"), PAIRS)
@pytest.mark.parametrize(("m", "n", "k"), [(1024, 2304, 768), (48, 32, 16)])
def test_cuda_gemm_fp8_adds_its_bias_before_the_rounding(library, fa, fb, m, n, k) -> None:
    """GemmFp8 with its optional bias (rule 8; cuBLASLt's bias epilogue, or the rounding pass of a
    float32 plan): numpy's product plus the bf16 bias, within the bound of the product alone, and
    the same as the product without the bias plus the bias to within a bf16 rounding step."""
    feeds = _feeds(m, n, k)
    feeds["C"] = (np.random.default_rng(n).standard_normal(n) * 8).astype(np.float32)
    got = _session(_gemm_fp8_graph(fa, fb, m, n, k, alpha=0.5, bias=True), library).run(None, feeds)[0]
    want = gemm_fp8_reference(feeds["A"], feeds["B"], fa, fb, 0.25, 2.0, 0.5, bias=feeds["C"])
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    plain = _session(_gemm_fp8_graph(fa, fb, m, n, k, alpha=0.5), library).run(None, {k_: v for k_, v in feeds.items() if k_ != "C"})[0]
    added = plain + feeds["C"].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.all(np.abs(got - added) <= np.maximum(np.abs(plain), np.abs(added)) * 2.0**-7 * 1.01 + 1e-30)


def test_gemm_fp8_runs_inside_a_captured_cuda_graph(library) -> None:
    """ORT captures the session's run and replays it (enable_cuda_graph, inputs and output
    bound on the device): the replays give the plain session's result, bit for bit."""
    m, n, k = 1024, 768, 768
    model = _gemm_fp8_graph(E5M2, E4M3, m, n, k, alpha=1.0)
    feeds = _feeds(m, n, k)
    want = _session(model, library).run(None, feeds)[0]
    session = _session(model, library, graph=True)
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    out = ort.OrtValue.ortvalue_from_numpy(np.zeros((m, n), np.float32), "cuda", 0)
    binding.bind_ortvalue_output("Y", out)
    for _ in range(3):  # warm-up, capture, replay
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(out.numpy(), want)


def test_an_fp8_training_step_is_captured_whole(library, monkeypatch) -> None:
    """The zoo GPT's native fp8 step on CUDA with ``cuda_graph=True`` (an error if it cannot be
    captured): its fp8 products are GemmFp8, and four steps match the same step run without
    CUDA graphs."""
    from mpgraph.runtime.trainer import Trainer

    step = _gpt_step(emulate=False)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 64, (4, 16)), "label": rng.integers(0, 64, (4, 16))} for _ in range(4)]
    graphed, plain = Trainer(step, "cuda", cuda_graph=True), Trainer(step.clone(), "cuda", cuda_graph=False)
    losses = [[t.step(b).loss for b in batches] for t in (graphed, plain)]
    assert graphed.cuda_graph and dict(graphed.executor.plan.applied)["fp8_gemm"] == 27
    assert b"GemmFp8" in graphed.executor.plan.graph and b"GemmFloat8" not in graphed.executor.plan.graph
    for op in (b"Fp8Transpose", b"CastToFloat8E4M3FNAmax", b"CastToFloat8E5M2Amax", b"CastTransposeToFloat8E5M2"):
        assert op in graphed.executor.plan.graph, op
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-3)
    # Rule 6 off (MPGRAPH_FP8_GEMM=ort: GemmFloat8, float32 cuts, ReduceMax(Abs), Cast): the
    # same fp8 values and products, other kernels and sums.
    monkeypatch.setenv("MPGRAPH_FP8_GEMM", "ort")
    ort_side = Trainer(step.clone(), "cuda", cuda_graph=False)
    assert b"GemmFloat8" in ort_side.executor.plan.graph and b"GemmFp8" not in ort_side.executor.plan.graph
    np.testing.assert_allclose(losses[0], [ort_side.step(b).loss for b in batches], rtol=1e-2)


@pytest.mark.parametrize("amax", [False, True], ids=["cast", "cast+amax"])
@pytest.mark.parametrize("dtype", [T.BFLOAT16, T.FLOAT16, T.FLOAT])
@pytest.mark.parametrize("to", [T.FLOAT8E4M3FN, T.FLOAT8E5M2])
def test_cuda_cast_to_float8_equals_the_cpu_reference(library, to, dtype, amax) -> None:
    """CastToFloat8* and CastToFloat8*Amax on CUDA (cuda_fp8.h, __NV_SATFINITE; 16 bytes of X a
    thread, the last elements one a thread) against the CPU kernel, which tests/test_lowering_fp8.py
    checks against ORT's Cast(saturate=1) and AbsMax: every bf16 bit pattern and 5 more (a tail
    past the vectors), at a scale that sends some past the largest finite value, read as bf16,
    float16 or float32; then normal values without a NaN, whose amax is a number."""
    from onnx import helper as h

    name = ("CastToFloat8E4M3FN" if to == T.FLOAT8E4M3FN else "CastToFloat8E5M2") + ("Amax" if amax else "")
    n = 2**16 + 5
    nodes = [h.make_node("Cast", ["X"], ["x"], to=dtype),
             h.make_node(name, ["x", "s"], ["q", "A"] if amax else ["q"], domain="ai.mpgraph"),
             h.make_node("Cast", ["q"], ["Y"], to=T.FLOAT)]
    outputs = [h.make_tensor_value_info("Y", T.FLOAT, [n])] + ([h.make_tensor_value_info("A", T.FLOAT, [])] if amax else [])
    graph = h.make_graph(nodes, "c", [h.make_tensor_value_info("X", T.FLOAT, [n]), h.make_tensor_value_info("s", T.FLOAT, [])],
                         outputs)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    rng = np.random.default_rng(0)
    every = np.concatenate([(np.arange(2**16, dtype=np.uint32) << 16).view(np.float32), rng.standard_normal(5).astype(np.float32)])
    normal = rng.standard_normal(n).astype(np.float32)
    normal[rng.integers(n)] = -300.5
    got = _cuda_equals_cpu(model.SerializeToString(), library, [{"X": x, "s": np.array(4.0, np.float32)} for x in (every, normal)])
    if amax:
        assert got[1] == np.abs(normal.astype({T.FLOAT: np.float32, T.BFLOAT16: ml_dtypes.bfloat16,
                                               T.FLOAT16: np.float16}[dtype]).astype(np.float32)).max()


@pytest.mark.parametrize("dtype", [T.BFLOAT16, T.FLOAT16, T.FLOAT])
@pytest.mark.parametrize("to", [T.FLOAT8E4M3FN, T.FLOAT8E5M2])
@pytest.mark.parametrize("shape", [(4, 1024, 768), (100, 72), (68, 132), (37, 50)])
def test_cuda_cast_transpose_equals_the_cpu_reference(library, shape, to, dtype) -> None:
    """CastTransposeToFloat8* on CUDA (64 x 64 tiles of four-element loads where both dims are
    multiples of 4, partial tiles at 100 x 72 and 68 x 132; the cast and the byte transpose one
    after the other at 37 x 50) against the CPU kernel: Q, QT and Amax, every byte, with a NaN
    and without."""
    from onnx import helper as h

    name = "CastTransposeToFloat8E4M3FN" if to == T.FLOAT8E4M3FN else "CastTransposeToFloat8E5M2"
    rows = int(np.prod(shape[:-1]))
    nodes = [h.make_node("Cast", ["X"], ["x"], to=dtype), h.make_node(name, ["x", "s"], ["q", "t", "A"], domain="ai.mpgraph"),
             h.make_node("Cast", ["q"], ["Q"], to=T.FLOAT), h.make_node("Cast", ["t"], ["QT"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "ct", [h.make_tensor_value_info("X", T.FLOAT, list(shape)), h.make_tensor_value_info("s", T.FLOAT, [])],
                         [h.make_tensor_value_info("Q", T.FLOAT, list(shape)), h.make_tensor_value_info("QT", T.FLOAT, [shape[-1], rows]),
                          h.make_tensor_value_info("A", T.FLOAT, [])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    x = (np.random.default_rng(rows).standard_normal(shape) * 60).astype(np.float32)
    with_nan = x.copy()
    with_nan.reshape(-1)[rows // 2] = np.nan
    _cuda_equals_cpu(model.SerializeToString(), library, [{"X": v, "s": np.array(4.0, np.float32)} for v in (x, with_nan)])


@pytest.mark.parametrize("shape", [(2048, 768), (4, 1024, 768), (100, 72), (68, 132), (37, 50), (1, 16)])
def test_cuda_fp8_transpose_moves_the_bits(library, shape) -> None:
    """Fp8Transpose on CUDA: X's leading dims flattened, transposed, every byte as it was. Dims
    that are multiples of 4 take the word kernel (partial 64 x 64 tiles: 100 x 72, 68 x 132), the
    others the byte kernel."""
    from onnx import helper as h

    nodes = [h.make_node("Cast", ["X"], ["q"], to=T.FLOAT8E5M2, saturate=1),
             h.make_node("Fp8Transpose", ["q"], ["t"], domain="ai.mpgraph"), h.make_node("Cast", ["t"], ["Y"], to=T.FLOAT)]
    rows = int(np.prod(shape[:-1]))
    graph = h.make_graph(nodes, "t", [h.make_tensor_value_info("X", T.FLOAT, list(shape))],
                         [h.make_tensor_value_info("Y", T.FLOAT, [shape[-1], rows])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = _session(model.SerializeToString(), library).run(None, {"X": x})[0]
    want = x.astype(ml_dtypes.float8_e5m2).astype(np.float32).reshape(rows, shape[-1]).T
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [T.FLOAT, T.BFLOAT16, T.FLOAT16])
@pytest.mark.parametrize("size", [1, 1000, 8192 * 2048 + 7])
def test_cuda_absmax_is_the_largest_magnitude(library, dtype, size) -> None:
    """AbsMax on CUDA: max |x| of the values in their own type, the largest placed at random;
    with a NaN among them, NaN."""
    from onnx import helper as h

    nodes = [h.make_node("Cast", ["X"], ["x"], to=dtype), h.make_node("AbsMax", ["x"], ["Y"], domain="ai.mpgraph")]
    graph = h.make_graph(nodes, "a", [h.make_tensor_value_info("X", T.FLOAT, [size])], [h.make_tensor_value_info("Y", T.FLOAT, [])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    session = _session(model.SerializeToString(), library)
    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(np.float32)
    x[rng.integers(size)] = -300.5
    low = {T.FLOAT: np.float32, T.BFLOAT16: ml_dtypes.bfloat16, T.FLOAT16: np.float16}[dtype]
    assert session.run(None, {"X": x})[0] == np.abs(x.astype(low).astype(np.float32)).max()
    x[rng.integers(size)] = np.nan
    assert np.isnan(session.run(None, {"X": x})[0])
