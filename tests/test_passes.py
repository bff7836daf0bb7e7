"""Precision passes on small graphs whose node names state the expected category.

Names follow grappler's tests: ``allow1`` is an allow op, ``deny1`` a deny op, ``infer1`` an
infer op, ``clear1`` a clear op; the assertions read like the spec.
"""

from __future__ import annotations

import copy
import itertools

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.audit import audit
from mpgraph.dtypes import FLOAT_FORMATS, is_lossless
from mpgraph.errors import MpgraphError
from mpgraph.passes.assign_precision import AssignPrecisionPass
from mpgraph.passes.fold_casts import FoldCastsPass
from mpgraph.passes.infer_types import InferTypesPass
from mpgraph.passes.insert_casts import InsertCastsPass
from mpgraph.policy import load_policy, parse_policy
from tests.helpers import init, make_model, mlp_model, run, vi


def precision(model: ir.Model, name: str) -> str:
    return model.graph.node(name).metadata_props[md.NODE_PRECISION]


def casts(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "Cast"]


def test_phases_on_mlp():
    m = mpgraph.convert(mlp_model(), "bf16")
    assert precision(m, "allow1") == "bfloat16"
    assert precision(m, "allow2") == "bfloat16"
    assert precision(m, "infer1") == "bfloat16"  # between allow1 and allow2
    assert precision(m, "clear1") == "bfloat16"
    assert precision(m, "deny1") == "float32"
    assert precision(m, "infer2") == "float32"  # deny spreads forward
    assert "deny spreads forward" in m.graph.node("infer2").metadata_props[md.NODE_REASON]
    # One cast in (x), one cast back (d before softmax); weights are stored low, not cast.
    assert [n.name for n in casts(m)] == ["cast/x_bf16", "cast/d_fp32"]
    assert m.graph.initializers["w1"].dtype == ir.DataType.BFLOAT16
    assert m.graph.initializers["b1"].dtype == ir.DataType.BFLOAT16
    assert m.graph.inputs[0].dtype == ir.DataType.FLOAT
    assert m.graph.outputs[0].dtype == ir.DataType.FLOAT
    report = audit(m)
    assert report.casts_inserted == 2
    assert report.weight_bytes_after * 2 == report.weight_bytes_before


def test_infer_follows_allow_at_graph_end():
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"], name="allow1"),
        h.make_node("Add", ["a", "b"], ["y"], name="infer1"),
    ]
    model = make_model(
        nodes, [vi("x", [2, 4])], [vi("y", [2, 3])],
        [init("w", np.ones((4, 3), np.float32)), init("b", np.ones(3, np.float32))],
    )
    m = mpgraph.convert(model, "fp16")
    assert precision(m, "infer1") == "float16"
    # keep_io_types: the output keeps its name and float32 through one cast.
    assert m.graph.outputs[0].name == "y" and m.graph.outputs[0].dtype == ir.DataType.FLOAT
    assert m.graph.outputs[0].producer().op_type == "Cast"


def test_infer_with_float32_inputs_stays_float32():
    nodes = [h.make_node("Add", ["x", "x"], ["y"], name="infer1")]
    m = mpgraph.convert(make_model(nodes, [vi("x", [2])], [vi("y", [2])]), "bf16")
    assert precision(m, "infer1") == "float32"
    assert casts(m) == []


def test_clear_feeding_only_low_ops_becomes_low():
    nodes = [
        h.make_node("Reshape", ["x", "shape"], ["r"], name="clear1"),
        h.make_node("MatMul", ["r", "w"], ["y"], name="allow1"),
    ]
    model = make_model(
        nodes, [vi("x", [2, 2, 2])], [vi("y", [2, 3])],
        [init("shape", np.array([2, 4], np.int64)), init("w", np.ones((4, 3), np.float32))],
    )
    m = mpgraph.convert(model, "bf16")
    assert precision(m, "clear1") == "bfloat16"
    assert m.graph.node("clear1").inputs[0].name == "cast/x_bf16"


def test_float_tensor_feeding_shape_arithmetic_is_never_lowered():
    """A float scale computed by MatMul feeds Resize's scales: the MatMul stays float32."""
    rng = np.random.default_rng(0)
    nodes = [
        h.make_node("MatMul", ["s", "one"], ["scales"], name="allow_shape"),
        h.make_node("Resize", ["x", "", "scales"], ["y"], name="infer1", mode="nearest"),
    ]
    model = make_model(
        nodes, [vi("x", [1, 1, 2, 2]), vi("s", [1, 4])], [vi("y", None)],
        [init("one", np.eye(4, dtype=np.float32))],
    )
    m = mpgraph.convert(model, "fp16")
    assert precision(m, "allow_shape") == "float32"
    assert "feeds shape arithmetic" in m.graph.node("allow_shape").metadata_props[md.NODE_REASON]
    x = rng.standard_normal((1, 1, 2, 2)).astype(np.float32)
    s = np.array([[1, 1, 2, 2]], np.float32)
    np.testing.assert_array_equal(run(m, {"x": x, "s": s})[0], run(model, {"x": x, "s": s})[0])


def test_integer_tensors_are_never_touched():
    nodes = [
        h.make_node("Shape", ["x"], ["s"], name="none1"),
        h.make_node("MatMul", ["x", "w"], ["y"], name="allow1"),
    ]
    model = make_model(
        nodes, [vi("x", [2, 4])], [vi("y", [2, 3]), vi("s", [2], T.INT64)],
        [init("w", np.ones((4, 3), np.float32))],
    )
    m = mpgraph.convert(model, "bf16")
    assert precision(m, "none1") == "none"
    assert m.graph.node("none1").outputs[0].dtype == ir.DataType.INT64


def test_override_by_name_pattern_and_pin():
    policy = parse_policy(
        "extends: bf16\noverrides:\n  - {match: 'allow2', precision: float32, reason: keep head exact}\n",
        "mine.yaml",
    )
    m = mpgraph.convert(mlp_model(), policy)
    assert precision(m, "allow2") == "float32"
    assert "keep head exact" in m.graph.node("allow2").metadata_props[md.NODE_REASON]
    # The deny from the override spreads: nothing after allow2 is low.
    assert precision(m, "infer2") == "float32"


def test_opset_without_bfloat16_is_upgraded_and_recorded():
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")]
    model = make_model(
        nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", np.ones((4, 3), np.float32))], opset=11, ir_version=6
    )
    m = mpgraph.convert(model, "bf16")
    assert precision(m, "allow1") == "bfloat16"
    assert m.metadata_props[md.MODEL_OPSET_UPGRADED] == "11->13"
    kept = mpgraph.convert(model, "bf16", upgrade_opset=False)
    assert precision(kept, "allow1") == "float32"
    assert "has no bfloat16 type" in kept.graph.node("allow1").metadata_props[md.NODE_REASON]


def test_upgrade_to_opset_22_warns_about_ops_ort_cuda_cannot_run(caplog):
    """bf16 Conv needs opset 22, where ORT 1.31 CUDA registers no MaxPool kernel (any dtype)."""
    nodes = [h.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             h.make_node("MaxPool", ["c"], ["y"], name="pool", kernel_shape=[2, 2])]
    model = make_model(nodes, [vi("x", [1, 2, 6, 6])], [vi("y", [1, 3, 3, 3])],
                       [init("w", np.ones((3, 2, 3, 3), np.float32))], opset=18)
    with caplog.at_level("WARNING", logger="mpgraph"):
        m = mpgraph.convert(model, "bf16")
    assert m.metadata_props[md.MODEL_OPSET_UPGRADED] == "18->22"
    assert precision(m, "conv") == "bfloat16"
    assert any("no CUDA kernel for MaxPool" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mpgraph"):
        kept = mpgraph.convert(model, "bf16", upgrade_opset=False)
        mpgraph.convert(model, "bf16", emulate=True)  # CPU emulation: no CUDA warning
    assert precision(kept, "conv") == "float32"
    assert not any("CUDA" in r.getMessage() for r in caplog.records)


def test_initializer_overflow_keeps_consumer_float32_and_clamp_records():
    big = np.full((4, 3), 1e6, np.float32)
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")]
    model = make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", big)])
    m = mpgraph.convert(model, "fp16")
    assert precision(m, "allow1") == "float32"
    assert "exceeds float16 range" in m.graph.node("allow1").metadata_props[md.NODE_REASON]
    clamp = parse_policy("extends: fp16\ninitializers: {overflow: clamp}\n", "clamp.yaml")
    # The range check off: with it, the MatMul's 1e6-scale output would keep it float32 anyway.
    m2 = mpgraph.convert(make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", big)]), clamp, calibrate=None)
    assert precision(m2, "allow1") == "float16"
    events = audit(m2).initializer_range
    assert events == [{"name": "w", "overflow": 12, "underflow": 0, "action": "clamped to +-65504"}]
    assert float(m2.graph.initializers["w"].const_value.numpy().max()) == 65504.0
    strict = parse_policy("extends: fp16\ninitializers: {overflow: error}\n", "strict.yaml")
    with pytest.raises(MpgraphError, match="beyond float16 range"):
        mpgraph.convert(make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", big)]), strict, calibrate=None)


def test_initializer_underflow_is_recorded():
    tiny = np.full((4, 3), 1e-9, np.float32)
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")]
    m = mpgraph.convert(make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", tiny)]), "fp16")
    assert precision(m, "allow1") == "float16"
    assert audit(m).initializer_range == [{"name": "w", "overflow": 0, "underflow": 12, "action": "stored low"}]


def test_shared_initializer_is_stored_once():
    """w feeds a low MatMul and a float32 Softmax: it stays fp32 and one Cast makes its low copy."""
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["y"], name="allow1"),
        h.make_node("Softmax", ["w"], ["z"], name="deny1"),
    ]
    m = mpgraph.convert(
        make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3]), vi("z", [3, 3])], [init("w", np.eye(3, dtype=np.float32))]),
        "bf16",
    )
    assert m.graph.initializers["w"].dtype == ir.DataType.FLOAT
    assert [n.name for n in casts(m)] == ["cast/x_bf16", "cast/w_bf16", "cast/y_bf16_fp32"]
    assert [v.name for v in m.graph.node("allow1").inputs] == ["cast/x_bf16", "cast/w_bf16"]
    assert [v.name for v in m.graph.node("deny1").inputs] == ["w"]
    assert len(m.graph.initializers) == 1


def test_keep_io_types_false_lowers_inputs_and_outputs():
    policy = parse_policy("extends: fp16\nkeep_io_types: false\n", "io.yaml")
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")]
    m = mpgraph.convert(
        make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", np.ones((4, 3), np.float32))]), policy
    )
    assert m.graph.inputs[0].dtype == ir.DataType.FLOAT16
    assert m.graph.outputs[0].dtype == ir.DataType.FLOAT16
    assert casts(m) == []
    out = run(m, {"x": np.ones((2, 4), np.float16)})[0]
    assert out.dtype == np.float16 and np.all(out == 4)


def test_control_flow_bodies_stay_float32_with_outer_scope_cast_back():
    """A low value captured by an If body is cast back to float32 in the outer graph."""
    rng = np.random.default_rng(0)
    then_body = h.make_graph([h.make_node("Relu", ["a"], ["t"], name="then_relu")], "then", [], [vi("t", [2, 3])])
    else_body = h.make_graph([h.make_node("Neg", ["a"], ["e"], name="else_neg")], "else", [], [vi("e", [2, 3])])
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"], name="allow1"),
        h.make_node("If", ["cond"], ["y"], name="if1", then_branch=then_body, else_branch=else_body),
    ]
    model = make_model(
        nodes, [vi("x", [2, 4]), vi("cond", [], T.BOOL)], [vi("y", [2, 3])],
        [init("w", rng.standard_normal((4, 3)).astype(np.float32))],
    )
    m = mpgraph.convert(model, "bf16")
    assert precision(m, "allow1") == "bfloat16"
    assert precision(m, "if1") == "float32"
    x = rng.standard_normal((2, 4)).astype(np.float32)
    emu = mpgraph.convert(model, "bf16", emulate=True)
    for cond in (True, False):
        got = run(emu, {"x": x, "cond": np.array(cond)})[0]
        ref = run(model, {"x": x, "cond": np.array(cond)})[0]
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)


def test_fp32_preset_is_bit_identical():
    rng = np.random.default_rng(0)
    model = mlp_model()
    x = rng.standard_normal((5, 4)).astype(np.float32)
    m = mpgraph.convert(model, "fp32")
    assert casts(m) == []
    np.testing.assert_array_equal(run(m, {"x": x})[0], run(model, {"x": x})[0])


@pytest.mark.parametrize("policy", ["fp16", "bf16", "torch-autocast", "tf-amp"])
@pytest.mark.parametrize("emulate", [False, True])
def test_idempotent(policy, emulate):
    once = mpgraph.convert(mlp_model(), policy, emulate=emulate)
    before = ir.to_proto(once).SerializeToString()
    twice = mpgraph.convert(once, policy, emulate=emulate)
    assert ir.to_proto(twice).SerializeToString() == before


def test_converting_with_a_different_dtype_is_refused():
    once = mpgraph.convert(mlp_model(), "bf16")
    with pytest.raises(MpgraphError, match="already converted to bfloat16"):
        mpgraph.convert(once, "fp16")


def test_emulation_keeps_fp16_underflow_on_cpu():
    """Values below fp16's smallest subnormal must become zeros on ORT CPU, as on a GPU."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")]
    model = make_model(nodes, [vi("x", [1, 3])], [vi("y", [1, 3])], [init("w", np.eye(3, dtype=np.float32))])
    x = np.array([[1e-8, 2e-8, 1.0]], np.float32)
    emu = mpgraph.convert(model, "fp16", emulate=True)
    y = run(emu, {"x": x})[0]
    np.testing.assert_array_equal(y, [[0.0, 0.0, 1.0]])
    # bf16 keeps float32's range: no underflow, only 8-bit rounding.
    y_bf = run(mpgraph.convert(model, "bf16", emulate=True), {"x": x})[0]
    np.testing.assert_allclose(y_bf, x, rtol=2**-8)
    assert (y_bf != 0).all()


def test_emulation_matches_numpy_rounding():
    """Emulated bf16 MatMul equals numpy: round inputs to bf16, fp32 matmul, round output."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")]
    model = make_model(nodes, [vi("x", [4, 16])], [vi("y", [4, 8])], [init("w", w)])
    x = rng.standard_normal((4, 16)).astype(np.float32)
    bf = ml_dtypes.bfloat16
    want = (x.astype(bf).astype(np.float32) @ w.astype(bf).astype(np.float32)).astype(bf).astype(np.float32)
    got = run(mpgraph.convert(model, "bf16", emulate=True), {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=2**-7)
    assert np.mean(got == want) > 0.9  # summation order may flip a last bit



def test_emulation_leaves_omitted_optional_outputs_alone():
    """An ``Attention`` whose ``present_key``/``present_value`` are omitted (named ``""``) and
    whose ``qk_matmul_output`` is kept, as in onnx's ``test_attention_4d_with_qk_matmul``: the
    emulation rounded the omitted outputs too, with Casts reading ``""`` that ORT refused
    ("input 0 is marked single but has an empty string"), so the fp16 range check, which runs
    the emulated lowering, failed (a warning under ``calibrate="auto"``). Now only values
    something reads are rounded: the check runs, and the emulation matches float32."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    nodes = [h.make_node("Attention", ["q", "k", "v"], ["y", "", "", "qk"], name="attn")]
    model = make_model(nodes, [vi(n, [1, 2, 3, 4]) for n in "qkv"], [vi("y", [1, 2, 3, 4]), vi("qk", [1, 2, 3, 3])],
                       opset=23, ir_version=11)
    feeds = {"q": q, "k": k, "v": v}
    native = mpgraph.convert(copy.deepcopy(model), "fp16", calibrate=feeds)
    assert native.graph.node("attn").metadata_props["mpgraph.precision"] == "float16"
    emu = mpgraph.convert(copy.deepcopy(model), "fp16", emulate=True, calibrate=feeds)
    assert all(i is None or i.name for n in emu.graph for i in n.inputs)
    for want, got in zip(run(model, feeds), run(emu, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)

FLOATS = [d for d in FLOAT_FORMATS if d not in (ir.DataType.DOUBLE,)]


def _all_values(dtype: ir.DataType) -> np.ndarray:
    """Every value of an 8- or 16-bit float; for wider ones random bit patterns plus the extremes."""
    np_dtype = np.dtype(dtype.numpy())
    if np_dtype.itemsize == 1:
        return np.arange(256, dtype=np.uint8).view(np_dtype)
    if np_dtype.itemsize == 2:
        return np.arange(65536, dtype=np.uint16).view(np_dtype)
    rng = np.random.default_rng(1)
    info = np.finfo(np_dtype)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, info.smallest_subnormal, info.smallest_normal, info.max,
         1 + info.eps, 65504, 65520, 1e-8],
        np_dtype,
    )
    if np_dtype.itemsize == 4:
        bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    else:
        bits = rng.integers(0, 2**63, 200_000, dtype=np.uint64) | np.uint64(1 << 63) * rng.integers(0, 2, 200_000, dtype=np.uint64)
    return np.concatenate([bits.view(np_dtype), special])


def _same_values(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Elementwise: equal bits (so -0 differs from +0), or both NaN."""
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    with np.errstate(invalid="ignore"):
        nan_x, nan_y = np.isnan(x.astype(np.float64)), np.isnan(y.astype(np.float64))
    return (x.view(uint) == y.view(uint)) | (nan_x & nan_y)


@pytest.mark.parametrize("a,b", list(itertools.product(FLOAT_FORMATS, repeat=2)), ids=str)
def test_is_lossless_matches_a_round_trip(a, b):
    """is_lossless(a, b) exactly when every value of a survives a -> b -> a (all values of 8/16-bit a).

    A pair ruled lossy must lose a value here: the rule cannot be stricter than the numbers
    (it was, for fp8 e5m2fnuz -> fp16, a missed fold).
    """
    x = _all_values(a)
    with np.errstate(all="ignore"):
        back = x.astype(b.numpy()).astype(a.numpy())
    assert bool(_same_values(x, back).all()) == is_lossless(a, b)


LOSSLESS_TRIPLES = [(a, b, c) for a, b, c in itertools.product(FLOATS, repeat=3) if is_lossless(a, b)]


def test_lossless_triples_are_counted():
    """7 pairs a == b plus 14 lossless pairs a != b among the 7 formats, each with 7 targets c."""
    assert len(LOSSLESS_TRIPLES) == (7 + 14) * 7


@pytest.mark.parametrize("a,b,c", LOSSLESS_TRIPLES, ids=str)
def test_cast_fold_rule_is_exact_over_all_float_triples(a, b, c):
    """Where is_lossless(a, b), Cast(Cast(x, b), c) == Cast(x, c) for every value x of a."""
    x = _all_values(a)
    with np.errstate(all="ignore"):
        two = x.astype(b.numpy()).astype(c.numpy())
        one = x.astype(c.numpy())
    assert _same_values(two, one).all()


def test_lossless_table():
    F, H, B, D = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE
    assert is_lossless(H, F) and is_lossless(B, F) and is_lossless(F, D)
    assert not is_lossless(F, H) and not is_lossless(F, B) and not is_lossless(H, B) and not is_lossless(B, H)


def test_fold_removes_lossless_pairs_only():
    nodes = [
        h.make_node("Cast", ["x"], ["a"], name="c1", to=T.FLOAT16),
        h.make_node("Cast", ["a"], ["b"], name="c2", to=T.FLOAT),
        h.make_node("Cast", ["b"], ["c"], name="c3", to=T.FLOAT16),
        h.make_node("Cast", ["x"], ["d"], name="c4", to=T.FLOAT16),
        h.make_node("Add", ["c", "d"], ["y"], name="add"),
    ]
    model = ir.from_proto(make_model(nodes, [vi("x", [3])], [vi("y", [3], T.FLOAT16)]))
    result = FoldCastsPass()(model)
    assert result.modified
    # c3(c2(c1(x))): fp16->fp32 is lossless, so c3 reads a (fp16) and is an identity; c4 duplicates c1.
    remaining = [n.name for n in model.graph if n.op_type == "Cast"]
    assert remaining == ["c1"]
    assert not FoldCastsPass()(model).modified


def test_passes_report_modified_exactly():
    model = ir.from_proto(mlp_model())
    policy = load_policy("bf16")
    InferTypesPass()(model)
    assert AssignPrecisionPass(policy)(model).modified
    assert not AssignPrecisionPass(policy)(model).modified
    assert InsertCastsPass(policy)(model).modified
    assert not InsertCastsPass(policy)(model).modified


def test_external_data_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    model = mlp_model()
    x = rng.standard_normal((2, 4)).astype(np.float32)
    ref = run(model, {"x": x})[0]
    src = tmp_path / "ext.onnx"
    onnx.save_model(model, src, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data", size_threshold=0)
    dst = tmp_path / "out.onnx"
    m = mpgraph.convert_file(src, dst, "bf16")
    assert dst.exists() and precision(m, "allow1") == "bfloat16"
    emu = tmp_path / "emu.onnx"
    mpgraph.convert_file(src, emu, "bf16", emulate=True)
    got = run(onnx.load(str(emu)), {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-2)
    m2 = mpgraph.load_model(src)
    mpgraph.save_model(m2, tmp_path / "forced.onnx", external_data=True)
    assert (tmp_path / "forced.onnx.data").exists()
    onnx.checker.check_model(str(tmp_path / "forced.onnx"), full_check=True)
