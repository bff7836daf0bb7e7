"""The ``fp8_gemm`` lowering: fp8 products onto ``com.microsoft.GemmFloat8`` (CUDA only).

ORT's CPU provider has no GemmFloat8 kernel, so these tests check the rewrite two ways on the
CPU: its structure against the op schema ONNX Runtime itself lists (inputs, attributes, type
constraints, the fp8 layout transA=0/transB=1), and its numbers, by replacing each GemmFloat8
with the schema's documented math in standard ops, ``Cast(Cast(A, float) * scaleA) @
(Cast(B, float) * scaleB)^T * alpha`` (``GemmFloatReference``), and running the step before and
after the rewrite on ORT CPU: the same losses, parameters and fp8 state.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.lowering import PlanOptions, plan_session
from mpgraph.lowering.fp8_gemm import lower_fp8_gemms
from mpgraph.lowering.registry import RULES, Exactness
from mpgraph.policy import parse_policy
from mpgraph.training import build_training_graph
from tests.helpers import cpu_session

ROOT = Path(__file__).resolve().parents[1]
E4M3, E5M2 = ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2
BF16, FLOAT = ir.DataType.BFLOAT16, ir.DataType.FLOAT


def _gpt_step(emulate: bool, policy: str = "fp8") -> ir.Model:
    # Attention written out (canonicalize=None without target="cuda" keeps it so): its four
    # products per layer are the batched ones the rule must leave emulated.
    step = build_training_graph(ROOT / "models" / "onnx" / "gpt.loss.onnx", optimizer="adamw", lr=3e-3,
                                target=None)
    return mpgraph.convert(step, parse_policy(policy, "p.yaml") if "\n" in policy else policy, emulate=emulate,
                           validate=False, calibrate=None)


@pytest.fixture(scope="module")
def native() -> tuple[ir.Model, ir.Model]:
    """The zoo GPT's native fp8 step (bf16 products) before and after the rewrite."""
    step = _gpt_step(emulate=False)
    lowered = ir.from_proto(ir.to_proto(step))
    lower_fp8_gemms(lowered)
    return step, lowered


def _gemms(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "GemmFloat8" and n.domain == "com.microsoft"]


def test_the_rule_is_registered_for_cuda_only_as_approximate() -> None:
    rule = next(r for r in RULES if r.name == "fp8_gemm")
    assert rule.exactness is Exactness.APPROXIMATE
    # ORT's own op, no kernel library: it runs in every CUDA scope, ``native`` included.
    assert all(rule.runs("cuda", scope) for scope in ("all", "default", "native")) and not rule.runs("cpu", "all")


def test_every_linear_product_becomes_a_gemm_float8_and_attention_stays(native, caplog) -> None:
    step, lowered = native
    products = [n for n in step.graph if md.NODE_FP8 in n.metadata_props]
    # 9 forward linear products (qkv, proj, fc, out per layer, the head), 18 backward ones
    # (input and weight gradient of each); the 12 attention products (batched B) stay.
    assert len(products) == 39 and len(_gemms(lowered)) == 27
    left = [n for n in lowered.graph if md.NODE_FP8 in n.metadata_props and n.op_type == "MatMul"]
    assert len(left) == 12 and all(len(n.inputs[1].shape) == 4 for n in left)
    with caplog.at_level(logging.INFO, logger="mpgraph.lowering.fp8_gemm"):
        lower_fp8_gemms(ir.from_proto(ir.to_proto(step)))
    assert "27 of 39 fp8 products native (0 on the library's GemmFp8, the others on GemmFloat8); left emulated: " \
        "{'batched B': 12}" in caplog.text
    # The dequantise chains of the rewritten products are gone; those of attention remain.
    widen = [n for n in lowered.graph if n.op_type == "Cast" and n.inputs[0].dtype in (E4M3, E5M2)]
    assert len(widen) == len({id(v) for n in left for v in n.inputs[:2]})
    assert lower_fp8_gemms(lowered) == 0  # nothing left to rewrite


def test_gemm_float8_nodes_follow_the_schema_onnxruntime_lists(native) -> None:
    schema = next(s for s in ort_c.get_all_operator_schema() if s.name == "GemmFloat8" and s.domain == "com.microsoft")
    allowed = {t.type_param_str: set(t.allowed_type_strs) for t in schema.type_constraints}
    params = [i.typeStr for i in schema.inputs]
    _, lowered = native
    formats = Counter()
    for node in _gemms(lowered):
        assert set(node.attributes) <= set(schema.attributes)
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["transA"] == 0 and attrs["transB"] == 1
        # E4M3 x E4M3 into the product's bf16; a mixed pair into float32 (cuBLASLt on the H200
        # refuses it into bf16), then one Cast back to bf16.
        y = node.outputs[0]
        want = BF16 if node.inputs[0].dtype == node.inputs[1].dtype == E4M3 else FLOAT
        assert attrs["dtype"] == want.value and y.dtype == want, node.name
        assert f"tensor({want.name.lower()})" in allowed[schema.outputs[0].typeStr]
        if want == FLOAT:
            (cast, _), = y.uses()
            assert cast.op_type == "Cast" and cast.attributes["to"].as_int() == BF16.value, node.name
            assert cast.outputs[0].dtype == BF16 and cast.outputs[0].shape == y.shape, node.name
        assert len(node.inputs) == 5 and node.inputs[2] is None
        for value, param in zip(node.inputs, params):
            if value is not None:
                assert f"tensor({value.dtype.name.lower()})" in allowed[param], (node.name, param, value.dtype)
        a, b, _, scale_a, scale_b = node.inputs
        assert a.shape is not None and b.shape is not None and len(a.shape) == len(b.shape) == 2
        k_a, k_b = a.shape[1], b.shape[1]
        assert not (isinstance(k_a, int) and isinstance(k_b, int)) or k_a == k_b, node.name
        assert isinstance(b.shape[0], int) and b.shape[0] % 16 == 0
        # Scales are the quantised tensors' 1/s, as the product's metadata names them.
        names = {(e["fp8"], e["scale_inv"]) for e in json.loads(node.metadata_props[md.NODE_FP8]).values()}
        assert {s.name for s in (scale_a, scale_b)} <= {inv for _, inv in names}
        assert scale_a.dtype == scale_b.dtype == ir.DataType.FLOAT
        formats[(a.dtype.name, b.dtype.name, node.metadata_props[md.NODE_ROLE])] += 1
    # Forward E4M3 x E4M3; input gradients E5M2 x E4M3 (dY W^T); weight gradients E4M3 x E5M2.
    assert formats == {("FLOAT8E4M3FN", "FLOAT8E4M3FN", "forward"): 9, ("FLOAT8E5M2", "FLOAT8E4M3FN", "backward"): 9,
                       ("FLOAT8E4M3FN", "FLOAT8E5M2", "backward"): 9}


def test_every_value_keeps_its_type(native) -> None:
    """The float32 outputs of the mixed-pair GemmFloat8 are cast back: every value of the step
    that is still there (the products' outputs included, by name) has its type, and every
    reader of a GemmFloat8's result gets the product's bf16."""
    step, lowered = native
    before = {v.name: v.type for n in step.graph for v in n.outputs if v.name}
    after = {v.name: v.type for n in lowered.graph for v in n.outputs if v.name}
    products = [n.outputs[0].name for n in step.graph if md.NODE_FP8 in n.metadata_props]
    assert set(products) <= after.keys()
    assert {k: t for k, t in after.items() if k in before} == {k: before[k] for k in after if k in before}
    casts = [n for n in lowered.graph if n.op_type == "Cast" and n.inputs[0].producer() is not None
             and n.inputs[0].producer().op_type == "GemmFloat8"]
    assert len(casts) == 18 and all(n.outputs[0].dtype == BF16 for n in casts)
    again = ir.from_proto(ir.to_proto(step))
    lower_fp8_gemms(again)  # the same names each time (byte pins, plan caches)
    assert [(n.name, *(v.name for v in n.outputs)) for n in again.graph] == \
        [(n.name, *(v.name for v in n.outputs)) for n in lowered.graph]


def test_onnxruntime_resolves_the_types_and_lacks_only_the_cuda_kernel(native) -> None:
    """ORT type-checks the whole lowered step with its own GemmFloat8 schema (dtype against
    the declared output types) before it looks for kernels; on the CPU it then stops at the
    first GemmFloat8, for want of a kernel, not at a type error."""
    _, lowered = native
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED : Could not find an implementation for GemmFloat8"):
        ort.InferenceSession(ir.to_proto(lowered).SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_input_gradients_read_the_quantised_values_without_a_copy(native) -> None:
    """``Gemm(dY, W, transB=1)`` is GemmFloat8's own layout: it reads the pass's fp8 values;
    the forward's weight and both weight-gradient operands are cut again, transposed."""
    _, lowered = native
    for node in _gemms(lowered):
        a, b = node.inputs[:2]
        if node.metadata_props[md.NODE_ROLE] == "forward":
            assert b.producer().inputs[0].producer().op_type == "Transpose"
        elif a.dtype == E5M2:
            assert a.name.startswith("fp8/") and b.name.startswith("fp8/"), node.name
        else:
            assert {v.producer().inputs[0].producer().op_type for v in (a, b)} == {"Transpose"}


def test_e5m2_pairs_and_unaligned_dims_stay_emulated(caplog) -> None:
    # Every tensor E5M2: every product is E5M2 x E5M2, which cuBLASLt has no kernel for.
    step = _gpt_step(emulate=False, policy="extends: fp8\nfp8: {forward: float8e5m2, backward: float8e5m2}")
    with caplog.at_level(logging.INFO, logger="mpgraph.lowering.fp8_gemm"):
        assert lower_fp8_gemms(step) == 0
    assert "left emulated: {'e5m2 x e5m2': 39}" in caplog.text
    caplog.clear()
    tiny = build_training_graph(ROOT / "models" / "onnx" / "tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05, target="cuda")
    tiny = mpgraph.convert(tiny, "fp8", emulate=False, validate=False, calibrate=None)
    with caplog.at_level(logging.INFO, logger="mpgraph.lowering.fp8_gemm"):
        count = lower_fp8_gemms(tiny)
    # 4-64-64-2: only the middle layer's products have N and K multiples of 16.
    assert "'N or K not a multiple of 16'" in caplog.text and 0 < count < 9, caplog.text


def test_plan_session_on_cuda_lowers_fp8_and_cpu_does_not() -> None:
    step = _gpt_step(emulate=False)
    cuda = plan_session(step, "cuda", PlanOptions(scope="native"))
    assert dict(cuda.applied)["fp8_gemm"] == 27
    assert "fp8_gemm" not in dict(plan_session(step, "cpu", PlanOptions(scope="native")).applied)


# --- numbers: GemmFloat8 as its documented math, on ORT CPU -----------------------------------


def _reference_expansion(model: ir.Model) -> int:
    """Replace each GemmFloat8 by the schema's math in standard ops (``A``, ``B`` widened and
    multiplied by their scales, transposed per the flags, multiplied, times ``alpha``, cast to
    ``dtype``); how many were replaced."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "GemmFloat8":
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        a, b, c, scale_a, scale_b = node.inputs
        assert c is None
        made: list[ir.Node] = []

        def op(kind: str, *inputs: ir.Value, made: list[ir.Node] = made, **kw: object) -> ir.Value:
            made.append(ir.node(kind, list(inputs), attributes=kw))
            return made[-1].outputs[0]

        x = op("Mul", op("Cast", a, to=ir.DataType.FLOAT), scale_a)
        w = op("Mul", op("Cast", b, to=ir.DataType.FLOAT), scale_b)
        x = op("Transpose", x, perm=[1, 0]) if attrs.get("transA", 0) else x
        w = op("Transpose", w, perm=[1, 0]) if attrs.get("transB", 0) else w
        y = op("MatMul", x, w)
        alpha = ir.Value(name=f"{node.name}/alpha", const_value=ir.tensor(np.array(attrs.get("alpha", 1.0), np.float32)))
        graph.register_initializer(alpha)
        y = op("Cast", op("Mul", y, alpha), to=ir.DataType(attrs["dtype"]))
        graph.insert_before(node, made)
        old = node.outputs[0]
        old.replace_all_uses_with(y, replace_graph_outputs=True)
        y.name, old.name = old.name, None
        y.dtype, y.shape = old.dtype, old.shape
        graph.remove(node, safe=True)
        count += 1
    return count


def _run_step(model: ir.Model, feeds: dict[str, np.ndarray], library: bool = False) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if library:
        from mpgraph import lowering as kernels

        options.register_custom_ops_library(str(kernels.library("cpu")))
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


@pytest.mark.parametrize("library", [False, True], ids=["float32 cuts", "Fp8Transpose cuts"])
def test_the_rewritten_step_computes_what_the_emulated_step_computes(library: bool) -> None:
    """The emulated fp8 GPT step (float32 products on dequantised operands) against the same
    step rewritten onto GemmFloat8, GemmFloat8 evaluated as its documented math: every output
    (loss, parameters, moments, fp8 scales and amax history) agrees to float32 rounding. With
    the library (rule 6; its products are float32, so GemmFloat8 stays), the transposed operands
    are Fp8Transpose's, the amaxes AbsMax's and most quantisations CastToFloat8*'s (most of
    those with their tensor's amax, CastToFloat8*Amax), run by the library's CPU kernels."""
    step = _gpt_step(emulate=True)
    lowered = ir.from_proto(ir.to_proto(step))
    assert lower_fp8_gemms(lowered, library=library) == 24
    # Each transposed cut: a float32 Transpose and a Cast, or one Fp8Transpose.
    ops = Counter(n.op_type for n in lowered.graph)
    own = sum(n.op_type == "Transpose" for n in step.graph)
    # (Rule 9: most of them made by their cast, CastTransposeToFloat8*.)
    made_with_cast = ops["CastTransposeToFloat8E4M3FN"] + ops["CastTransposeToFloat8E5M2"]
    assert (ops["Fp8Transpose"] + made_with_cast, ops["Transpose"] - own) == ((21, 0) if library else (0, 21)), ops
    assert made_with_cast == (15 if library else 0), ops
    # Each quantised tensor's amax: ReduceMax(Abs(x)), or one AbsMax, or (rule 7, the delayed
    # recipe's scale is from earlier steps) an output of that tensor's CastToFloat8*Amax or
    # CastTransposeToFloat8*.
    read_with_cast = ops["CastToFloat8E4M3FNAmax"] + ops["CastToFloat8E5M2Amax"] + made_with_cast
    assert (ops["AbsMax"] + read_with_cast, ops["Abs"]) == ((39, 0) if library else (0, 39)), ops
    assert read_with_cast == (30 if library else 0), ops
    # Quantisations whose float32 product nothing else reads: one CastToFloat8* each.
    assert ops["CastToFloat8E4M3FN"] + ops["CastToFloat8E5M2"] + read_with_cast == (47 if library else 0), ops
    assert _reference_expansion(lowered) == 24
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 64, (4, 16)), "label": rng.integers(0, 64, (4, 16))}
    # Scales other than the initial ones, so each product's scaleA/scaleB wiring counts.
    count = step.graph.initializers["fp8/scales"].shape[0]
    feeds["fp8/scales"] = (2.0 ** rng.integers(-3, 4, count)).astype(np.float32)
    before, after = _run_step(step, feeds), _run_step(lowered, feeds, library=library)
    assert before.keys() == after.keys()
    for name, want in before.items():
        got = after[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-5, atol=1e-6, err_msg=name)
    plain = {k: v for k, v in feeds.items() if k != "fp8/scales"}
    assert not np.array_equal(before["loss"], _run_step(_gpt_step(emulate=True, policy="bf16"), plain)["loss"])


def test_every_declared_dim_of_the_gemm_operands_is_the_size_that_runs() -> None:
    """A weight gradient reduces over the tokens, a symbolic count (batch x 16 here) of which
    the rule knows only a static factor: enough for the alignment check, but the cut operands
    must not declare that factor as their size. ORT plans buffers from declared static shapes
    (on CUDA a wrong one failed: "Shape mismatch attempting to re-use buffer. {6144,2048} !=
    {6144,8192}"). Every GemmFloat8 operand, run at batch 4, has the static dims it declares."""
    step = _gpt_step(emulate=True)
    lowered = ir.from_proto(ir.to_proto(step))
    lower_fp8_gemms(lowered)
    operands = {v.name: v for n in _gemms(lowered) for v in n.inputs[:2]}
    declared = {name: list(v.shape) for name, v in operands.items()}
    _reference_expansion(lowered)
    for name, v in operands.items():  # numpy has no float8: each read back widened
        widen = ir.node("Cast", [v], attributes={"to": ir.DataType.FLOAT})
        lowered.graph.append(widen)
        widen.outputs[0].name = name + "/widened"
        lowered.graph.outputs.append(widen.outputs[0])
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 64, (4, 16)), "label": rng.integers(0, 64, (4, 16))}
    got = _run_step(lowered, feeds)
    symbolic = 0
    for name, dims in declared.items():
        shape = got[name + "/widened"].shape
        assert len(shape) == len(dims), name
        for want, size in zip(dims, shape):
            if isinstance(want, int):
                assert want == size, (name, dims, shape)
            else:
                symbolic += 1
    assert symbolic > 0  # the weight gradients' token axes stay undeclared


# --- rule 6: the kernel library's GemmFp8 (capturable; CPU reference here) --------------------


def _gemm_fp8_graph(fa: ir.DataType, fb: ir.DataType, m: int, n: int, k: int, alpha: float, bias: bool = False) -> bytes:
    """``Y = float(GemmFp8(Cast(A, fa), Cast(B, fb), sa, sb[, Cast(C, bf16)]; alpha))`` with ``Yb``
    its bf16 output."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    nodes = [h.make_node("Cast", ["A"], ["qa"], to=fa.value, saturate=1), h.make_node("Cast", ["B"], ["qb"], to=fb.value, saturate=1),
             h.make_node("GemmFp8", ["qa", "qb", "sa", "sb", *(["cb"] if bias else [])], ["Yb"], domain="ai.mpgraph", alpha=alpha),
             h.make_node("Cast", ["Yb"], ["Y"], to=T.FLOAT)]
    inputs = [h.make_tensor_value_info("A", T.FLOAT, [m, k]), h.make_tensor_value_info("B", T.FLOAT, [n, k]),
              h.make_tensor_value_info("sa", T.FLOAT, []), h.make_tensor_value_info("sb", T.FLOAT, [])]
    if bias:
        nodes.insert(0, h.make_node("Cast", ["C"], ["cb"], to=T.BFLOAT16))
        inputs.append(h.make_tensor_value_info("C", T.FLOAT, [n]))
    graph = h.make_graph(nodes, "gemm_fp8", inputs, [h.make_tensor_value_info("Y", T.FLOAT, [m, n])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model, strict_mode=True).SerializeToString()


def gemm_fp8_reference(a: np.ndarray, b: np.ndarray, fa: ir.DataType, fb: ir.DataType, sa: float, sb: float,
                       alpha: float, bias: np.ndarray | None = None) -> np.ndarray:
    """GemmFp8 in numpy: the operands rounded to their formats with saturation (ml_dtypes),
    ``A B^T`` in float64, times ``alpha * sa * sb`` (in float32), plus ``bias`` rounded to bf16
    where given, rounded once to bf16 (as float32)."""
    import ml_dtypes

    def quantise(x: np.ndarray, fmt: ir.DataType) -> np.ndarray:
        t = ml_dtypes.float8_e4m3fn if fmt == E4M3 else ml_dtypes.float8_e5m2
        top = float(ml_dtypes.finfo(t).max)
        return np.clip(x, -top, top).astype(t).astype(np.float64)

    y = ((quantise(a, fa) @ quantise(b, fb).T) * (np.float32(alpha) * np.float32(sa) * np.float32(sb))).astype(np.float32)
    if bias is not None:
        y = y + bias.astype(ml_dtypes.bfloat16).astype(np.float32)
    return y.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize(("fa", "fb"), [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_gemm_fp8_cpu_reference_is_the_fp8_product_rounded_once(fa, fb) -> None:
    """Every pair the lowering writes, with values that saturate (1000 > 448), flush or land
    in the subnormals: the CPU op equals numpy on the ml_dtypes-rounded operands (the sums here
    are exact in float32: few terms of few bits)."""

    rng = np.random.default_rng(1)
    m, n, k = 5, 6, 32
    a = np.round(rng.standard_normal((m, k)) * 8).astype(np.float32)
    b = np.round(rng.standard_normal((n, k)) * 4).astype(np.float32) / 4
    a[0, :4], b[1, :3] = [1000.0, -3e-3, 1e-9, 0.0], [2.0**-8, -2.0**-15, 70000.0]
    session = cpu_session(_gemm_fp8_graph(fa, fb, m, n, k, alpha=0.5), library=True)
    feeds = {"A": a, "B": b, "sa": np.array(0.25, np.float32), "sb": np.array(2.0, np.float32)}
    got = session.run(None, feeds)[0]
    np.testing.assert_array_equal(got, gemm_fp8_reference(a, b, fa, fb, 0.25, 2.0, 0.5))
    # With a bias (rule 8): added to the float32 product, then the one rounding.
    c = (rng.standard_normal(n) * 3).astype(np.float32)
    with_bias = cpu_session(_gemm_fp8_graph(fa, fb, m, n, k, alpha=0.5, bias=True), library=True).run(None, {**feeds, "C": c})[0]
    np.testing.assert_array_equal(with_bias, gemm_fp8_reference(a, b, fa, fb, 0.25, 2.0, 0.5, bias=c))
    assert not np.array_equal(with_bias, got)


def _quantised(value: ir.Value) -> tuple[str | None, str | None, bool]:
    """What a product's fp8 operand is, whichever ops made it: (the value quantised, read
    through a widening of a bf16 value, a 2-D Transpose and any Flatten or Reshape, since
    quantising commutes with them; its scale; transposed or not). A scale input is itself."""
    transposed, node, read = False, value.producer(), value
    while node is not None:
        if node.op_type.startswith("CastTransposeToFloat8"):  # its second output is Fp8Transpose(q)
            transposed ^= read is node.outputs[1]
        if node.op_type == "Mul" or node.op_type.startswith(("CastToFloat8", "CastTransposeToFloat8")):
            x, scale = node.inputs
            widen = x.producer()
            if widen is not None and widen.op_type == "Cast" and widen.inputs[0].dtype == BF16:
                x = widen.inputs[0]
            flip = x.producer()
            if flip is not None and flip.op_type == "Transpose" and x.shape is not None and x.shape.rank() == 2:
                x, transposed = flip.inputs[0], not transposed
            while x.producer() is not None and x.producer().op_type in ("Flatten", "Reshape"):  # the same bytes
                x = x.producer().inputs[0]
            return x.name, scale.name, transposed
        if node.op_type not in ("Fp8Transpose", "Transpose", "Reshape", "Cast"):
            break
        transposed ^= node.op_type in ("Fp8Transpose", "Transpose")
        read = node.inputs[0]
        node = read.producer()
    return value.name, None, transposed


def test_with_the_library_bf16_products_read_what_gemm_float8_would_on_gemm_fp8(native, monkeypatch) -> None:
    """Rule 6: the same 27 products, each GemmFp8 reading GemmFloat8's A', B' and scales, writing
    the product's bf16 itself (no float32 output and Cast for the mixed pairs); its readers are
    the ones the product had. ``MPGRAPH_FP8_GEMM=ort`` keeps GemmFloat8."""
    step, lowered = native
    with_library = ir.from_proto(ir.to_proto(step))
    assert lower_fp8_gemms(with_library, library=True) == 27
    fp8 = {n.name.rsplit("/", 1)[0]: n for n in with_library.graph if n.op_type == "GemmFp8"}
    ort_gemms = {n.name.rsplit("/", 1)[0]: n for n in _gemms(lowered)}
    assert len(fp8) == 27 and fp8.keys() == ort_gemms.keys() and not _gemms(with_library)
    assert with_library.opset_imports.get("ai.mpgraph") == 1 and "com.microsoft" not in with_library.opset_imports
    swapped, biased = set(), set()
    for name, node in fp8.items():
        theirs = ort_gemms[name]
        assert node.domain == "ai.mpgraph" and len(node.inputs) in (4, 5)
        if len(node.inputs) == 5:  # rule 8: the bias the product's Add read, through its Reshape or not
            (read, _), = theirs.outputs[0].uses()
            add = read if read.op_type == "Add" else next(iter(read.outputs[0].uses()))[0]
            assert add.op_type == "Add" and node.inputs[4].name in [v.name for v in add.inputs], name
            biased.add(name)
        mine, want = [_quantised(v) for v in node.inputs[:4]], [_quantised(v) for v in theirs.inputs if v is not None]
        if node.metadata_props.get("mpgraph.fp8_swapped") == "1":  # (A' B'^T)^T = B' A'^T: a Transpose absorbed
            want = [want[1], want[0], want[3], want[2]]
            swapped.add(name)
        assert mine == want, name
        assert node.attributes["alpha"].as_float() == theirs.attributes["alpha"].as_float()
        assert node.outputs[0].dtype == BF16, name
    assert swapped, "no weight gradient's Transpose was absorbed"
    # Each layer's bf16 bias Adds (qkv, fc1); the out-projection's and fc2's are float32 Adds after a Cast.
    assert len(biased) == 4, biased
    # What each product's result feeds: GemmFloat8's through the Cast of rule 5 (and the Transpose
    # a swapped GemmFp8 absorbed), GemmFp8's directly.
    def fed(model: ir.Model, op: str) -> dict[str, list[str]]:
        out = {}
        for n in model.graph:
            if n.op_type == op:
                (y,) = n.outputs
                (cast, _), = y.uses() if y.dtype == FLOAT else ((None, None),)
                y = cast.outputs[0] if cast is not None else y
                if op == "GemmFloat8" and n.name.rsplit("/", 1)[0] in swapped:
                    (flip, _), = y.uses()
                    assert flip.op_type == "Transpose"
                    y = flip.outputs[0]
                out[n.name.rsplit("/", 1)[0]] = sorted(re.sub(r"/fp8_gemm/(\w+)_\d+$", r"/fp8_gemm/\1", u.node.name)
                                                       for u in y.uses())  # the lowering's own: by kind
        return out

    assert fed(with_library, "GemmFp8") == fed(lowered, "GemmFloat8")
    # Every amax is an AbsMax or a CastToFloat8*Amax's second output (rule 7), of the bf16 value
    # itself where the pass widened one to float32.
    amaxes = [n for n in with_library.graph if n.op_type in ("AbsMax", "CastToFloat8E4M3FNAmax", "CastToFloat8E5M2Amax",
                                                               "CastTransposeToFloat8E4M3FN", "CastTransposeToFloat8E5M2")]
    assert len(amaxes) == 39 and not any(n.op_type == "Abs" for n in with_library.graph)
    assert sum(n.op_type != "AbsMax" for n in amaxes) > 20
    read = Counter(n.inputs[0].dtype.name for n in amaxes)
    assert read["BFLOAT16"] > 0 and read["BFLOAT16"] + read["FLOAT"] == 39, read
    assert not any(n.inputs[0].producer() is not None and n.inputs[0].producer().op_type == "Cast"
                   and n.inputs[0].producer().inputs[0].dtype == BF16 for n in amaxes)
    monkeypatch.setenv("MPGRAPH_FP8_GEMM", "ort")
    again = ir.from_proto(ir.to_proto(step))
    assert lower_fp8_gemms(again, library=True) == 27 and len(_gemms(again)) == 27


def test_rule_7_reads_each_delayed_amax_with_its_cast_and_leaves_the_current_recipe_alone() -> None:
    """With the delayed recipe a scale comes from earlier steps, so each quantised tensor's
    AbsMax and its CastToFloat8* become one CastToFloat8*Amax (the zoo GPT's native step: all 39
    amaxes). With the current recipe the scale is this step's amax: the two stay apart."""
    def lowered(policy: str) -> Counter:
        model = ir.from_proto(ir.to_proto(_gpt_step(emulate=False, policy=policy)))
        lower_fp8_gemms(model, library=True)
        return Counter(n.op_type for n in model.graph)

    def with_cast(ops: Counter) -> int:  # amaxes read by a cast (rule 9 adds the transpose to 27 of them)
        return sum(ops[f"Cast{how}ToFloat8{fmt}"] for how, fmt in (("", "E4M3FNAmax"), ("", "E5M2Amax"),
                                                                  ("Transpose", "E4M3FN"), ("Transpose", "E5M2")))

    delayed = lowered("fp8")
    assert (with_cast(delayed), delayed["AbsMax"]) == (39, 0), delayed
    assert delayed["CastTransposeToFloat8E4M3FN"] + delayed["CastTransposeToFloat8E5M2"] == 27, delayed
    current = lowered("extends: bf16\nfp8: {scaling: {recipe: current}}\n")
    assert (with_cast(current), current["AbsMax"]) == (0, 39), current


@pytest.mark.parametrize("to", [E4M3, E5M2])
def test_cast_to_float8_amax_is_the_cast_and_the_absmax_in_one(to) -> None:
    """CastToFloat8*Amax's CPU kernel: its Q is CastToFloat8*'s bit for bit and its Amax is
    AbsMax's, on every bf16 bit pattern (NaN wins), on values without a NaN and on none."""
    from onnx import TensorProto as T
    from onnx import helper as h

    name = "CastToFloat8E4M3FN" if to == E4M3 else "CastToFloat8E5M2"
    nodes = [h.make_node("Cast", ["X"], ["x"], to=T.BFLOAT16),
             h.make_node(name + "Amax", ["x", "s"], ["q1", "A1"], domain="ai.mpgraph"),
             h.make_node(name, ["x", "s"], ["q2"], domain="ai.mpgraph"), h.make_node("AbsMax", ["x"], ["A2"], domain="ai.mpgraph"),
             h.make_node("Cast", ["q1"], ["Y1"], to=T.FLOAT), h.make_node("Cast", ["q2"], ["Y2"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "c", [h.make_tensor_value_info("X", T.FLOAT, [None]), h.make_tensor_value_info("s", T.FLOAT, [])],
                         [h.make_tensor_value_info(v, T.FLOAT, [None] if v[0] == "Y" else []) for v in ("Y1", "A1", "Y2", "A2")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    session = cpu_session(model.SerializeToString(), library=True)
    rng = np.random.default_rng(0)
    every = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    normal = rng.standard_normal(1000).astype(np.float32)
    normal[17] = -300.7
    for x in (every, normal, np.zeros(0, np.float32)):
        y1, a1, y2, a2 = session.run(None, {"X": x, "s": np.array(4.0, np.float32)})
        assert y1.tobytes() == y2.tobytes() and a1.tobytes() == a2.tobytes()
    assert np.isnan(session.run(None, {"X": every, "s": np.array(4.0, np.float32)})[1])
    assert a1 == 0.0 and session.run(None, {"X": normal, "s": np.array(4.0, np.float32)})[1] == 300.0  # bf16 of 300.7


def test_the_backward_quantises_a_saved_activation_from_what_the_forward_quantised() -> None:
    """Each forward tensor's quantisations (its scale's ``x * s``) read one value, through data
    movement: the forward product's float32 input and the weight gradient's flattened copy of it,
    not that copy's bf16 rounding widened again (a second rounding, which can differ on an fp8
    tie, and a bf16 copy kept for the backward). So the fp8 values the weight gradient multiplies
    are the forward's, and rule 9 can share them (every transposed operand made by its cast)."""
    step = _gpt_step(emulate=False)
    moves = ("Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity")
    read: dict[str, set[str]] = {}
    for node in step.graph:
        if node.op_type == "Mul" and re.search(r"/scaled(_\d+)?$", node.name or ""):
            x = node.inputs[0]
            while x.producer() is not None and (x.producer().op_type in moves or (  # or an exact widening
                    x.producer().op_type == "Cast" and x.producer().inputs[0].dtype == BF16 and x.dtype == ir.DataType.FLOAT)):
                x = x.producer().inputs[0]
            read.setdefault(node.inputs[1].name, set()).add(x.name)
    forward = {scale: names for scale, names in read.items() if not scale.startswith("fp8/grad/")}
    assert len(forward) == 26 and all(len(names) == 1 for names in forward.values()), forward
    assert any(len(names) == 1 and next(iter(names)) == "layer_norm" for names in forward.values())


@pytest.mark.parametrize("to", [E4M3, E5M2])
def test_cast_transpose_to_float8_is_the_cast_and_its_transpose_in_one(to) -> None:
    """CastTransposeToFloat8*'s CPU kernel: Q and Amax are CastToFloat8*Amax's, QT is
    Fp8Transpose(Q) (leading dims flattened), bit for bit, on a 3-D bf16 input with a NaN, an
    infinity and values past the format's range."""
    from onnx import TensorProto as T
    from onnx import helper as h

    name = "CastToFloat8E4M3FN" if to == E4M3 else "CastToFloat8E5M2"
    nodes = [h.make_node("Cast", ["X"], ["x"], to=T.BFLOAT16),
             h.make_node(name.replace("CastTo", "CastTransposeTo"), ["x", "s"], ["q1", "t1", "A1"], domain="ai.mpgraph"),
             h.make_node(name + "Amax", ["x", "s"], ["q2", "A2"], domain="ai.mpgraph"),
             h.make_node("Fp8Transpose", ["q2"], ["t2"], domain="ai.mpgraph")]
    nodes += [h.make_node("Cast", [v], [v.upper()], to=T.FLOAT) for v in ("q1", "t1", "q2", "t2")]
    outs = ["Q1", "T1", "A1", "Q2", "T2", "A2"]
    graph = h.make_graph(nodes, "c", [h.make_tensor_value_info("X", T.FLOAT, [3, 5, 8]), h.make_tensor_value_info("s", T.FLOAT, [])],
                         [h.make_tensor_value_info(v, T.FLOAT, None) for v in outs])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    session = cpu_session(model.SerializeToString(), library=True)
    x = (np.random.default_rng(0).standard_normal((3, 5, 8)) * 100).astype(np.float32)
    x[0, 0, :3] = [np.inf, -1e6, 3e-4]
    for nan in (False, True):
        x[2, 4, 7] = np.nan if nan else 1.0
        got = dict(zip(outs, session.run(None, {"X": x, "s": np.array(4.0, np.float32)})))
        assert got["T1"].shape == (8, 15) and got["Q1"].shape == (3, 5, 8)
        for a, b in (("Q1", "Q2"), ("T1", "T2"), ("A1", "A2")):
            assert got[a].tobytes() == got[b].tobytes(), a
        assert np.isnan(got["A1"]) == nan


def test_absmax_cpu_reference_is_the_largest_magnitude_and_nan_wins() -> None:
    from onnx import TensorProto as T
    from onnx import helper as h


    nodes = [h.make_node("Cast", ["X"], ["x"], to=T.BFLOAT16), h.make_node("AbsMax", ["x"], ["Y"], domain="ai.mpgraph"),
             h.make_node("AbsMax", ["X"], ["Z"], domain="ai.mpgraph")]
    graph = h.make_graph(nodes, "a", [h.make_tensor_value_info("X", T.FLOAT, [None])],
                         [h.make_tensor_value_info(n, T.FLOAT, []) for n in "YZ"])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    session = cpu_session(model.SerializeToString(), library=True)
    x = np.array([0.5, -300.7, 2.0, -0.0], np.float32)
    y, z = session.run(None, {"X": x})
    assert (y, z) == (300.0, np.float32(300.7))  # bf16 rounds 300.7 to 300
    assert [float(v) for v in session.run(None, {"X": np.zeros(0, np.float32)})] == [0.0, 0.0]
    assert all(np.isnan(session.run(None, {"X": np.array([1.0, np.nan, -5.0], np.float32)})))


@pytest.mark.parametrize("to", [E4M3, E5M2])
def test_cast_to_float8_is_onnx_cast_with_saturation_on_every_bf16_value(to) -> None:
    """CastToFloat8*(x, s) against ORT CPU's Cast(x * s, saturate=1): every bf16 bit pattern
    (normals, subnormals, zeros, infinities, NaNs) and float32 extremes, at four scales; NaN
    where Cast gives NaN, else the same value."""
    from onnx import TensorProto as T
    from onnx import helper as h


    name = "CastToFloat8E4M3FN" if to == E4M3 else "CastToFloat8E5M2"
    nodes = [h.make_node(name, ["X", "s"], ["q"], domain="ai.mpgraph"), h.make_node("Mul", ["X", "s"], ["xs"]),
             h.make_node("Cast", ["xs"], ["r"], to=to.value, saturate=1),
             h.make_node("Cast", ["q"], ["qf"], to=T.FLOAT), h.make_node("Cast", ["r"], ["rf"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "c", [h.make_tensor_value_info("X", T.FLOAT, [None]), h.make_tensor_value_info("s", T.FLOAT, [])],
                         [h.make_tensor_value_info(n, T.FLOAT, [None]) for n in ("qf", "rf")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    model.ir_version = 10
    session = cpu_session(model.SerializeToString(), library=True)
    x = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    x = np.concatenate([x, np.array([3.4e38, 1e-45, 464, 480, 61439.9, 61440, 57344, 2.0**-10 * 3], np.float32)])
    for scale in (1.0, 2.0**-7, 2.0**10, 0.3):
        got, want = session.run(None, {"X": x, "s": np.array(scale, np.float32)})
        assert np.array_equal(np.isnan(got), np.isnan(want)), scale
        np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)], err_msg=str(scale))


def test_quantising_before_a_weight_transpose_keeps_every_bit() -> None:
    """Rule 6's ``quantise_before_transposes``: an exported weight's ``Transpose(W)`` read by its
    amax and its quantisation goes; the amax reads ``W``, the cast quantises ``W`` and an
    ``Fp8Transpose`` gives the old layout, which ``cancel_fp8_transposes`` removes where a
    product wanted ``W``'s own (here ``Y1``). The library's CPU kernels give the same bits."""
    from onnx import TensorProto as T
    from onnx import helper as h

    from mpgraph.lowering.fp8_layout import cancel_fp8_transposes, quantise_before_transposes

    nodes = [h.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
             h.make_node("AbsMax", ["wt"], ["amax"], domain="ai.mpgraph"),
             h.make_node("CastToFloat8E4M3FN", ["wt", "s"], ["q"], domain="ai.mpgraph"),
             h.make_node("Fp8Transpose", ["q"], ["qq"], domain="ai.mpgraph"),  # what the forward product reads
             h.make_node("Cast", ["qq"], ["Y1"], to=T.FLOAT), h.make_node("Cast", ["q"], ["Y2"], to=T.FLOAT)]
    graph = h.make_graph(nodes, "t", [h.make_tensor_value_info("W", T.FLOAT, [24, 40]), h.make_tensor_value_info("s", T.FLOAT, [])],
                         [h.make_tensor_value_info("amax", T.FLOAT, []), h.make_tensor_value_info("Y1", T.FLOAT, [24, 40]),
                          h.make_tensor_value_info("Y2", T.FLOAT, [40, 24])])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
    proto.ir_version = 10
    model = ir.from_proto(proto)
    model.graph.node(2).outputs[0].dtype = ir.DataType.FLOAT8E4M3FN  # the custom op's, which ONNX cannot infer
    model.graph.node(2).outputs[0].shape = ir.Shape([40, 24])
    assert quantise_before_transposes(model.graph) == 1 and cancel_fp8_transposes(model.graph) == 1
    ops = Counter(n.op_type for n in model.graph)
    assert ops["Transpose"] == 0 and ops["Fp8Transpose"] == 1, ops  # Y2's, of the bytes
    w = np.random.default_rng(0).standard_normal((24, 40)).astype(np.float32) * 300
    feeds = {"W": w, "s": np.array(0.75, np.float32)}
    want = cpu_session(proto.SerializeToString(), library=True).run(None, feeds)
    got = cpu_session(ir.to_proto(model).SerializeToString(), library=True).run(None, feeds)
    for g, x in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, x)
    assert float(got[0]) == float(np.abs(w).max()) and np.array_equal(got[2], got[1].T)


def test_a_transposed_gemm_fp8_is_the_product_with_its_operands_swapped() -> None:
    """Rule 6's ``absorb_output_transposes``: ``Transpose(GemmFp8(A', B', sa, sb))`` becomes
    ``GemmFp8(B', A', sb, sa)``; the library's CPU reference gives the same bits (the same
    terms summed in the same order, ``alpha * sb * sa`` the same float). Rows that are not a
    multiple of 16 (the new product's N) keep the Transpose."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    from mpgraph.lowering.fp8_layout import absorb_output_transposes

    def graph(m: int) -> onnx.ModelProto:
        n, k = 48, 64
        nodes = [h.make_node("Cast", ["A"], ["qa"], to=E4M3.value, saturate=1),
                 h.make_node("Cast", ["B"], ["qb"], to=E5M2.value, saturate=1),
                 h.make_node("GemmFp8", ["qa", "qb", "sa", "sb"], ["Yb"], domain="ai.mpgraph", alpha=0.5),
                 h.make_node("Transpose", ["Yb"], ["Ybt"], perm=[1, 0]), h.make_node("Cast", ["Ybt"], ["Y"], to=T.FLOAT)]
        inputs = [h.make_tensor_value_info("A", T.FLOAT, [m, k]), h.make_tensor_value_info("B", T.FLOAT, [n, k]),
                  h.make_tensor_value_info("sa", T.FLOAT, []), h.make_tensor_value_info("sb", T.FLOAT, [])]
        model = h.make_model(h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("Y", T.FLOAT, [n, m])]),
                             opset_imports=[h.make_opsetid("", 21), h.make_opsetid("ai.mpgraph", 1)])
        model.ir_version = 10
        return model

    rng = np.random.default_rng(0)
    proto = graph(32)
    model = ir.from_proto(proto)
    model.graph.node(2).outputs[0].dtype, model.graph.node(2).outputs[0].shape = BF16, ir.Shape([32, 48])
    assert absorb_output_transposes(model.graph) == 1
    (gemm,) = [n for n in model.graph if n.op_type == "GemmFp8"]
    assert not any(n.op_type == "Transpose" for n in model.graph) and gemm.metadata_props["mpgraph.fp8_swapped"] == "1"
    assert [v.name for v in gemm.inputs] == ["qb", "qa", "sb", "sa"]
    feeds = {"A": rng.standard_normal((32, 64)).astype(np.float32), "B": rng.standard_normal((48, 64)).astype(np.float32) * 4,
             "sa": np.array(2.0, np.float32), "sb": np.array(0.25, np.float32)}
    want = cpu_session(proto.SerializeToString(), library=True).run(None, feeds)[0]
    got = cpu_session(ir.to_proto(model).SerializeToString(), library=True).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)
    odd = ir.from_proto(graph(24))
    odd.graph.node(2).outputs[0].dtype, odd.graph.node(2).outputs[0].shape = BF16, ir.Shape([24, 48])
    assert absorb_output_transposes(odd.graph) == 0
