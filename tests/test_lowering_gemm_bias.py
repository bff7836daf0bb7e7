"""The ``gemm_bias`` rule: a float16/bfloat16 ``Gemm`` with a bias row as ``GemmBias`` (one
cuBLASLt matmul with the bias epilogue on CUDA; a float32-accumulating reference loop on CPU).

Which Gemms it takes (low precision, beta 1, C a row [N] or [1, N]; any transA, transB, alpha)
and which it leaves; that it is idempotent; that on a bf16 step graph it takes the forward
linear layers and none of the backward Gemms; and the CPU kernel against ORT CPU's own Gemm.

Tolerance, and why not bit-equality: both sides accumulate the products in float32, add the
bias in float32 and round once to the element type, but in another order (ORT CPU's MLAS
blocks K; the reference loop sums k in order), so their float32 sums differ by at most
K * 2^-23 * sum|a b| and the one rounding may then land on the neighbouring value: one ulp of
the element type at the result, plus that float32 bound where the sum cancels to near zero.
ORT CPU has no bfloat16 Gemm: the bfloat16 reference is its float32 Gemm of the same
(bfloat16-exact) values, rounded to bfloat16 by a Cast. The CUDA op against ORT CUDA's Gemm:
``tests/test_gpu_gemm_bias.py``. About 2 CPU-s.
"""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph import lowering
from mpgraph.lowering.gemm_bias import fuse_gemm_bias
from tests.helpers import run_named

M, K, N = 6, 37, 10
ULP_BITS = {T.FLOAT16: 10, T.BFLOAT16: 7}


def _gemm(dtype: int, *, trans_a: int = 0, trans_b: int = 0, alpha: float = 1.0, beta: float = 1.0,
          bias_shape: tuple[int, ...] | None = None, mkn: tuple[int, int, int] = (M, K, N)) -> ir.Model:
    """``y = float(Gemm(low(a), low(b), low(c)))`` with float32 inputs (ORT's Python API takes no
    bfloat16); ``dtype`` FLOAT: a plain float32 Gemm."""
    M, K, N = mkn  # noqa: N806 - the module's names for the sizes
    bias_shape = (N,) if bias_shape is None else bias_shape
    a_shape, b_shape = ((K, M) if trans_a else (M, K)), ((N, K) if trans_b else (K, N))
    nodes = [h.make_node("Cast", [x], [f"{x}_low"], to=dtype) for x in "abc"]
    nodes += [h.make_node("Gemm", ["a_low", "b_low", "c_low"], ["g"], name="linear", transA=trans_a, transB=trans_b,
                          alpha=alpha, beta=beta), h.make_node("Cast", ["g"], ["y"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "gemm", [h.make_tensor_value_info("a", T.FLOAT, a_shape),
                                         h.make_tensor_value_info("b", T.FLOAT, b_shape),
                                         h.make_tensor_value_info("c", T.FLOAT, bias_shape)],
                         [h.make_tensor_value_info("y", T.FLOAT, [M, N])])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def _feeds(trans_a: int = 0, trans_b: int = 0, bias_shape: tuple[int, ...] = (N,)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"a": rng.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32),
            "b": rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32),
            "c": rng.standard_normal(bias_shape).astype(np.float32)}


def _low(x: np.ndarray, dtype: int) -> np.ndarray:
    """``x`` rounded to ``dtype`` (to nearest, ties to even) and back to float32."""
    return x.astype(ml_dtypes.bfloat16 if dtype == T.BFLOAT16 else np.float16).astype(np.float32)


def _reference(dtype: int, feeds: dict[str, np.ndarray], **gemm) -> np.ndarray:
    """ORT CPU's float32 Gemm of the inputs rounded to ``dtype``, its output rounded to ``dtype``.
    ORT CPU has no bfloat16 Gemm, and on x86 its float16 one is the float32 kernel between Casts
    whose float32 -> float16 -> float32 pairs its graph transformers drop (the inputs' rounding
    with them), so it is no float16 reference as it stands."""
    return _low(run_named(_gemm(T.FLOAT, **gemm), {k: _low(v, dtype) for k, v in feeds.items()})["y"], dtype)


def _ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def _assert_within_one_ulp(got: np.ndarray, want: np.ndarray, dtype: int, feeds: dict[str, np.ndarray],
                           trans_a: int, trans_b: int, alpha: float) -> None:
    """|got - want| <= one ``dtype`` ulp at ``want`` + float32's summation bound (module docstring)."""
    a = feeds["a"].T if trans_a else feeds["a"]
    b = feeds["b"].T if trans_b else feeds["b"]
    exponent = np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -14)))
    ulp = 2.0 ** (exponent - ULP_BITS[dtype])
    sum_bound = K * 2.0 ** -23 * abs(alpha) * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(got - want) <= ulp + sum_bound), np.max(np.abs(got - want) / ulp)


@pytest.mark.parametrize("dtype", [T.FLOAT16, T.BFLOAT16])
def test_rewrites_low_precision_gemm_with_bias_row(dtype):
    model = _gemm(dtype)
    assert lowering.lower(model, "cpu", "all") >= 1
    ops = _ops(model)
    assert ops["GemmBias"] == 1 and ops["Gemm"] == 0
    node = next(n for n in model.graph if n.op_type == "GemmBias")
    assert node.domain == "ai.mpgraph" and node.outputs[0].name == "g" and node.name == "linear/GemmBias"
    assert fuse_gemm_bias(model) == 0  # idempotent: nothing left to take


@pytest.mark.parametrize(("case", "model"), [
    ("float32", lambda: _gemm(T.FLOAT)),
    ("beta", lambda: _gemm(T.BFLOAT16, beta=0.5)),
    ("full C", lambda: _gemm(T.BFLOAT16, bias_shape=(M, N))),
    ("column C", lambda: _gemm(T.BFLOAT16, bias_shape=(M, 1))),
])
def test_leaves_other_gemms(case, model):
    graph = model()
    assert fuse_gemm_bias(graph) == 0 and _ops(graph)["Gemm"] == 1, case


def test_cuda_needs_a_library_with_cublaslt_and_not_the_switch_off(monkeypatch):
    """On CUDA the rule runs by default where the library has the CUDA op (``Target.gemm_bias``;
    otherwise the Gemm stays ORT's: a CPU-only GemmBias would pull the node off the GPU);
    ``MPGRAPH_GEMM_BIAS=ort`` turns it off, ``cublaslt`` (the old opt-in) still means on."""
    from mpgraph.lowering.registry import RULES, Target

    rule = next(r for r in RULES if r.name == "gemm_bias")
    aligned = (8, 24, 16)
    monkeypatch.setenv("MPGRAPH_GEMM_BIAS", "ort")
    off = _gemm(T.BFLOAT16, mkn=aligned)
    assert rule.apply(off, Target("cuda", "default", gemm_bias=True)) == 0 and _ops(off)["Gemm"] == 1
    for asked in ("", "cublaslt"):
        monkeypatch.setenv("MPGRAPH_GEMM_BIAS", asked)
        without, with_ = _gemm(T.BFLOAT16, mkn=aligned), _gemm(T.BFLOAT16, mkn=aligned)
        assert rule.apply(without, Target("cuda", "default")) == 0 and _ops(without)["Gemm"] == 1
        assert rule.apply(with_, Target("cuda", "default", gemm_bias=True)) == 1, asked


@pytest.mark.parametrize(("mkn", "trans_a", "trans_b", "cuda"), [
    ((8, 24, 16), 0, 0, 1), ((8, 24, 16), 1, 1, 1), ((M, K, N), 0, 0, 0),  # 37 and 10 columns
    ((6, 24, 16), 0, 0, 1), ((6, 24, 16), 1, 0, 0),  # rows are A's leading dimension only when transposed
    ((8, 24, 12), 0, 1, 0),  # B stored [12, 24]: aligned; Y's 12 columns are not
])
def test_cuda_takes_only_gemms_whose_leading_dimensions_are_multiples_of_8(monkeypatch, mkn, trans_a, trans_b, cuda):
    """Elsewhere the CUDA op would fall back to ORT's own arithmetic (broadcast, then beta = 1):
    no gain, and not the one rounding the rule promises. The CPU reference takes every shape."""
    from mpgraph.lowering.registry import RULES, Target

    monkeypatch.setenv("MPGRAPH_GEMM_BIAS", "cublaslt")
    rule = next(r for r in RULES if r.name == "gemm_bias")
    on_cuda, on_cpu = (_gemm(T.BFLOAT16, mkn=mkn, trans_a=trans_a, trans_b=trans_b) for _ in range(2))
    assert rule.apply(on_cuda, Target("cuda", "default", gemm_bias=True)) == cuda
    assert rule.apply(on_cpu, Target("cpu", "all")) == 1


@pytest.mark.parametrize("dtype", [T.FLOAT16, T.BFLOAT16])
@pytest.mark.parametrize(("trans_a", "trans_b", "alpha", "bias_shape"),
                         [(0, 0, 1.0, (N,)), (1, 0, 1.0, (N,)), (0, 1, 0.5, (1, N)), (1, 1, 2.0, (N,))])
def test_cpu_kernel_matches_ort_gemm(dtype, trans_a, trans_b, alpha, bias_shape):
    gemm = {"trans_a": trans_a, "trans_b": trans_b, "alpha": alpha, "bias_shape": bias_shape}
    feeds = _feeds(trans_a, trans_b, bias_shape)
    want = _reference(dtype, feeds, **gemm)
    model = _gemm(dtype, **gemm)
    assert fuse_gemm_bias(model) == 1
    got = run_named(model, feeds, library=True)["y"]
    assert np.array_equal(got, _low(got, dtype))  # the kernel's output is of its type
    _assert_within_one_ulp(got, want, dtype, feeds, trans_a, trans_b, alpha)


def _linear_block() -> ir.Model:
    """``loss = sum(c * Gemm(gelu_tanh(Gemm(x, w, b)), v, u))``: GPT-2's MLP as its exports write
    it once mpgraph has lowered the step (2-D Gemms of the flattened activations, bias rows)."""
    rng = np.random.default_rng(0)
    n = h.make_node
    nodes = [n("Gemm", ["x", "w", "b"], ["a"]), n("Gelu", ["a"], ["g"], approximate="tanh"),
             n("Gemm", ["g", "v", "u"], ["o"]), n("Mul", ["o", "cw"], ["oc"]), n("ReduceSum", ["oc"], ["loss"], keepdims=0)]
    f = np.float32
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(f), name)
             for name, shape in (("w", (6, 16)), ("b", (16,)), ("v", (16, 4)), ("u", (4,)), ("cw", (5, 4)))]
    graph = h.make_graph(nodes, "mlp", [h.make_tensor_value_info("x", T.FLOAT, [5, 6])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]))


def test_bf16_step_takes_the_forward_linears_only():
    """In a bf16 AdamW step the two forward Gemms (bfloat16, bias rows) become GemmBias; the
    backward's Gemms (no C) and the float32 optimizer stay as they are."""
    from mpgraph.convert import convert
    from mpgraph.training import build_training_graph

    grads = build_training_graph(_linear_block(), optimizer="adamw", params=["w", "b", "v", "u"], target="cuda")
    step = convert(grads, "bf16", validate=False, calibrate=None, target="cuda")
    gemms = [n for n in step.graph if n.op_type == "Gemm"]
    forward = [n for n in gemms if len(n.inputs) == 3 and n.inputs[2] is not None]
    assert len(forward) == 2 and all(n.outputs[0].dtype == ir.DataType.BFLOAT16 for n in forward)
    names = {n.outputs[0].name for n in forward}
    assert fuse_gemm_bias(step) == 2
    ops = _ops(step)
    assert ops["GemmBias"] == 2 and ops["Gemm"] == len(gemms) - 2
    assert {n.outputs[0].name for n in step.graph if n.op_type == "GemmBias"} == names


# -- matmul_bias: MatMul/FusedMatMul + Add of a bias row -----------------------------------------

LEAD = (2, 3)  # A's leading dims: M = 6 rows


def _matmul_add(dtype: int, *, fused: bool = False, trans_b: int = 0, alpha: float = 1.0, bias_first: bool = False,
                bias_shape: tuple[int, ...] = (N,), second_reader: bool = False) -> ir.Model:
    """``y = float(Add(MatMul(low(a), low(b)), low(c)))`` with a [2, 3, K] (BERT's and ViT's
    linear layers); ``fused``: com.microsoft ``FusedMatMul`` (its ``transB`` and ``alpha``)."""
    nodes = [h.make_node("Cast", [x], [f"{x}_low"], to=dtype) for x in "abc"]
    if fused:
        nodes.append(h.make_node("FusedMatMul", ["a_low", "b_low"], ["p"], name="linear", domain="com.microsoft",
                                 transA=0, transB=trans_b, alpha=alpha))
    else:
        nodes.append(h.make_node("MatMul", ["a_low", "b_low"], ["p"], name="linear"))
    nodes.append(h.make_node("Add", ["c_low", "p"] if bias_first else ["p", "c_low"], ["s"]))
    nodes.append(h.make_node("Cast", ["s"], ["y"], to=T.FLOAT))
    outputs = [h.make_tensor_value_info("y", T.FLOAT, [*LEAD, N])]
    if second_reader:
        nodes.append(h.make_node("Cast", ["p"], ["p32"], to=T.FLOAT))
        outputs.append(h.make_tensor_value_info("p32", T.FLOAT, [*LEAD, N]))
    graph = h.make_graph(nodes, "linear", [h.make_tensor_value_info("a", T.FLOAT, [*LEAD, K]),
                                           h.make_tensor_value_info("b", T.FLOAT, (N, K) if trans_b else (K, N)),
                                           h.make_tensor_value_info("c", T.FLOAT, bias_shape)], outputs,
                         value_info=[h.make_tensor_value_info("p", dtype, [*LEAD, N])])  # FusedMatMul's: no inference
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


@pytest.mark.parametrize("dtype", [T.FLOAT16, T.BFLOAT16])
@pytest.mark.parametrize(("fused", "trans_b", "alpha", "bias_first"), [(False, 0, 1.0, False), (False, 0, 1.0, True),
                                                                      (True, 1, 0.5, False)])
def test_matmul_add_becomes_one_gemm_bias_rounded_once(dtype, fused, trans_b, alpha, bias_first):
    from mpgraph.lowering.gemm_bias import fuse_matmul_bias

    model = _matmul_add(dtype, fused=fused, trans_b=trans_b, alpha=alpha, bias_first=bias_first)
    assert fuse_matmul_bias(model) == 1
    ops = _ops(model)
    assert ops["GemmBias"] == 1 and ops["MatMul"] + ops["FusedMatMul"] + ops["Add"] == 0
    node = next(n for n in model.graph if n.op_type == "GemmBias")
    assert node.outputs[0].name == "s" and list(node.outputs[0].shape) == [*LEAD, N]
    assert fuse_matmul_bias(model) == 0
    rng = np.random.default_rng(4)
    feeds = {"a": rng.standard_normal((*LEAD, K)).astype(np.float32),
             "b": rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32),
             "c": rng.standard_normal(N).astype(np.float32)}
    got = run_named(model, feeds, library=True)["y"].reshape(M, N)
    flat = {"a": feeds["a"].reshape(M, K), "b": feeds["b"], "c": feeds["c"]}
    want = _reference(dtype, flat, trans_b=trans_b, alpha=alpha)
    _assert_within_one_ulp(got, want, dtype, flat, 0, trans_b, alpha)


@pytest.mark.parametrize(("case", "model"), [
    ("float32", lambda: _matmul_add(T.FLOAT)),
    ("product read twice", lambda: _matmul_add(T.BFLOAT16, second_reader=True)),
    ("full-shape addend", lambda: _matmul_add(T.BFLOAT16, bias_shape=(*LEAD, N))),
    ("column addend", lambda: _matmul_add(T.BFLOAT16, bias_shape=(*LEAD, 1))),
])
def test_matmul_bias_leaves_other_adds(case, model):
    from mpgraph.lowering.gemm_bias import fuse_matmul_bias

    graph = model()
    assert fuse_matmul_bias(graph) == 0 and _ops(graph)["Add"] == 1, case


def test_environment_switch_keeps_orts_ops(monkeypatch):
    """``MPGRAPH_GEMM_BIAS=ort``: both rules off (an A/B of a whole step)."""
    from mpgraph.lowering.gemm_bias import fuse_matmul_bias

    monkeypatch.setenv("MPGRAPH_GEMM_BIAS", "ort")
    gemm, matmul = _gemm(T.BFLOAT16), _matmul_add(T.BFLOAT16)
    assert fuse_gemm_bias(gemm) == 0 and fuse_matmul_bias(matmul) == 0
    assert _ops(gemm)["Gemm"] == 1 and _ops(matmul)["MatMul"] == 1


# -- gemm_bias_gelu: GemmBias -> Reshape -> Gelu(tanh), opt-in -----------------------------------


def _fc_gelu(dtype: int) -> ir.Model:
    """GPT-2's fc layer as lowered: ``G = Gelu(Reshape(Gemm(a, b, c), [2, 3, N]), "tanh")``; the
    Gelu's input X is an output too (the backward reads it)."""
    shape = onnx.numpy_helper.from_array(np.array([*LEAD, N], np.int64), "shape")
    nodes = [h.make_node("Cast", [x], [f"{x}_low"], to=dtype) for x in "abc"]
    nodes += [h.make_node("Gemm", ["a_low", "b_low", "c_low"], ["p"], name="fc"), h.make_node("Reshape", ["p", "shape"], ["x"]),
              h.make_node("Gelu", ["x"], ["g"], approximate="tanh"),
              h.make_node("Cast", ["g"], ["g32"], to=T.FLOAT), h.make_node("Cast", ["x"], ["x32"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "fc", [h.make_tensor_value_info("a", T.FLOAT, (M, K)), h.make_tensor_value_info("b", T.FLOAT, (K, N)),
                                       h.make_tensor_value_info("c", T.FLOAT, (N,))],
                         [h.make_tensor_value_info("g32", T.FLOAT, [*LEAD, N]), h.make_tensor_value_info("x32", T.FLOAT, [*LEAD, N])],
                         [shape])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def _gelu_tanh(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))


def test_gemm_bias_gelu_is_opt_in(monkeypatch):
    from mpgraph.lowering.gemm_bias import fuse_gemm_bias_gelu

    monkeypatch.delenv("MPGRAPH_GEMM_GELU", raising=False)
    model = _fc_gelu(T.BFLOAT16)
    assert fuse_gemm_bias(model) == 1 and fuse_gemm_bias_gelu(model) == 0 and _ops(model)["Gelu"] == 1


@pytest.mark.parametrize("dtype", [T.FLOAT16, T.BFLOAT16])
def test_gemm_bias_gelu_keeps_the_gelu_input_and_rounds_gelu_once(monkeypatch, dtype):
    """X (what the GELU's backward reads) is the rounded sum, as GemmBias makes it; G is the
    tanh GELU of the float32 sum rounded once: within one ulp of the float64 GELU of ORT CPU's
    float32 Gemm, plus GELU' times float32's summation bound."""
    from mpgraph.lowering.gemm_bias import fuse_gemm_bias_gelu

    monkeypatch.setenv("MPGRAPH_GEMM_GELU", "1")
    model = _fc_gelu(dtype)
    assert fuse_gemm_bias(model) == 1 and fuse_gemm_bias_gelu(model) == 1
    ops = _ops(model)
    assert ops["GemmBiasGelu"] == 1 and ops["GemmBias"] + ops["Gelu"] == 0 and ops["Reshape"] == 2
    assert fuse_gemm_bias_gelu(model) == 0
    feeds = _feeds()
    got = run_named(model, feeds, library=True)
    rounded = {k: _low(v, dtype) for k, v in feeds.items()}
    total = run_named(_gemm(T.FLOAT), rounded)["y"].astype(np.float64)  # ORT CPU's float32 sum
    want_x, want_g = _low(total.astype(np.float32), dtype), _low(_gelu_tanh(total).astype(np.float32), dtype)
    assert np.array_equal(got["x32"].reshape(M, N), _low(got["x32"], dtype).reshape(M, N))
    _assert_within_one_ulp(got["x32"].reshape(M, N), want_x, dtype, rounded, 0, 0, 1.0)
    _assert_within_one_ulp(got["g32"].reshape(M, N), want_g, dtype, rounded, 0, 0, 1.2)  # |GELU'| <= 1.13


def test_cuda_gemm_bias_gelu_takes_only_aligned_linears(monkeypatch):
    """gemm_bias_gelu on CUDA, as gemm_bias: a GemmBias at the unaligned [6, 37] x [37, 10]
    (what the CPU rule makes) keeps its Gelu there (the CUDA op's unaligned path was off on the
    H200); the CPU reference folds it."""
    from mpgraph.lowering.registry import RULES, Target

    monkeypatch.setenv("MPGRAPH_GEMM_GELU", "1")
    rule = next(r for r in RULES if r.name == "gemm_bias_gelu")
    unaligned, on_cpu = _fc_gelu(T.BFLOAT16), _fc_gelu(T.BFLOAT16)
    assert fuse_gemm_bias(unaligned) == 1 and fuse_gemm_bias(on_cpu) == 1
    assert rule.apply(unaligned, Target("cuda", "default", gemm_bias=True)) == 0 and _ops(unaligned)["Gelu"] == 1
    assert rule.apply(on_cpu, Target("cpu", "all")) == 1


def test_bf16_step_gelu_reading_the_gemm_directly(monkeypatch):
    """Without a Reshape between (the Gemm's output read by the Gelu and by its backward's ops),
    the GELU's backward reads GemmBiasGelu's aux output."""
    from mpgraph.convert import convert
    from mpgraph.lowering.gemm_bias import fuse_gemm_bias_gelu
    from mpgraph.training import build_training_graph

    monkeypatch.setenv("MPGRAPH_GEMM_GELU", "1")
    grads = build_training_graph(_linear_block(), optimizer="adamw", params=["w", "b", "v", "u"], target="cuda")
    step = convert(grads, "bf16", validate=False, calibrate=None, target="cuda")
    assert fuse_gemm_bias(step) == 2 and fuse_gemm_bias_gelu(step) == 1
    node = next(n for n in step.graph if n.op_type == "GemmBiasGelu")
    act, pre = node.outputs
    assert _ops(step)["Gelu"] == 0 and len(act.uses()) >= 1 and len(pre.uses()) >= 1
    assert {u.node.op_type for u in act.uses()}.isdisjoint({"Tanh", "TanhGeluGrad"})


def test_cuda_matmul_bias_takes_only_aligned_linears(monkeypatch):
    """matmul_bias on CUDA, as gemm_bias: the [2, 3, 37] x [37, 10] linear stays MatMul + Add
    there (37 and 10 no multiple of 8); the CPU reference takes it."""
    from mpgraph.lowering.registry import RULES, Target

    monkeypatch.setenv("MPGRAPH_GEMM_BIAS", "cublaslt")
    rule = next(r for r in RULES if r.name == "matmul_bias")
    on_cuda, on_cpu = _matmul_add(T.BFLOAT16), _matmul_add(T.BFLOAT16)
    assert rule.apply(on_cuda, Target("cuda", "default", gemm_bias=True)) == 0 and _ops(on_cuda)["Add"] == 1
    assert rule.apply(on_cpu, Target("cpu", "all")) == 1
