"""fp8 operands (policy ``fp8`` section, ``QuantizeFp8Pass``): the rounding, the scales, the state.

The references here are numpy and ml_dtypes, never the pass's own graph: the rounding is
``ml_dtypes`` (round to nearest even) after clipping to the format's largest finite value (the
saturation of ONNX ``Cast(saturate=1)``); the scale is ``2**floor(log2(fp8_max / amax /
2**margin))`` computed exactly (``np.frexp``); the delayed recipe's history is a list pushed by
hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.errors import PolicyError
from mpgraph.passes.quantize_fp8 import QuantizeFp8Pass
from mpgraph.policy import load_policy, parse_policy
from mpgraph.policy.schema import Fp8, Fp8Scaling
from mpgraph.training import build_training_graph

ROOT = Path(__file__).resolve().parents[1]
E4M3, E5M2 = ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2
NUMPY = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
F32 = np.float32


# --- references ----------------------------------------------------------------------------


def ref_quantize(x: np.ndarray, scale: float, fmt: ir.DataType) -> tuple[np.ndarray, np.ndarray]:
    """The fp8 values of ``x * scale`` (saturating) and the dequantised ``q * (1 / scale)``."""
    dtype = NUMPY[fmt]
    top = F32(ml_dtypes.finfo(dtype).max)
    y = x.astype(F32) * F32(scale)
    q = np.clip(y, -top, top).astype(dtype)  # NaN passes clip; inf becomes +-max
    return q, q.astype(F32) * (F32(1) / F32(scale))


def ref_scale(amax: float, old: float, fmt: ir.DataType, margin: int = 0, rounding: str = "pow2") -> np.float32:
    """Transformer Engine's scale for ``amax``: fp8_max / amax / 2**margin (power of two, rounded
    down, with ``pow2``), or ``old`` when amax is 0, inf or NaN or the ratio overflows."""
    top = F32(ml_dtypes.finfo(NUMPY[fmt]).max)
    amax = F32(amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        ratio = top / amax / F32(2.0**margin)
    if not (amax > 0 and np.isfinite(amax) and np.isfinite(ratio)):
        return F32(old)
    if rounding == "none":
        return F32(ratio)
    _, exponent = np.frexp(np.float64(ratio))  # ratio = m * 2**exponent, m in [0.5, 1)
    return F32(2.0 ** (int(exponent) - 1))


def value_classes(fmt: ir.DataType) -> np.ndarray:
    """``x * s`` targets of every class: each fp8 value, the midpoints between neighbours (ties)
    and one float32 step either side, subnormals and what flushes to zero, saturation, inf, NaN,
    signed zeros, float32 subnormals, and log-uniform random values."""
    dtype = NUMPY[fmt]
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(F32)
    finite = np.unique(codes[np.isfinite(codes)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(F32)
    top = F32(ml_dtypes.finfo(dtype).max)
    tiny = F32(ml_dtypes.finfo(dtype).smallest_subnormal)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, top * F32(1.0001), top * 2, 1e30, -1e30,
                        np.finfo(F32).max, 1e-45, -1e-45, tiny / 2, -tiny / 2, tiny * F32(0.51), tiny * F32(0.49),
                        tiny * F32(1.5), tiny * F32(2.5)], F32)
    rng = np.random.default_rng(0)
    random = (rng.choice([-1, 1], 2000) * 2.0 ** rng.uniform(-30, 20, 2000)).astype(F32)
    return np.concatenate([finite, mids, np.nextafter(mids, F32(np.inf)), np.nextafter(mids, F32(-np.inf)),
                           special, random]).astype(F32)


# --- a one-product graph ------------------------------------------------------------------------


def one_product(fp8: Fp8, rows: int, *, step_graph: bool) -> ir.Model:
    """``y = x @ w`` in float32 (as in the emulated lowering) with the product decided
    bfloat16, quantised by ``QuantizeFp8Pass``; marked a step graph (no state yet) or not."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 1])
    w = onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [1, 1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [rows, 1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="allow1")], "g", [x, w], [y])
    model = ir.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 19)], ir_version=9))
    model.graph.node("allow1").metadata_props[md.NODE_PRECISION] = "bfloat16"
    if step_graph:
        model.metadata_props[md.MODEL_TRAINING] = "true"
        model.metadata_props[md.MODEL_STATE_PAIRS] = "[]"
    assert QuantizeFp8Pass(fp8, ir.DataType.BFLOAT16)(model).modified
    return model


def session(model: ir.Model, extra: list[str]) -> ort.InferenceSession:
    """A CPU session of ``model`` (default optimisations, as the trainer's) with ``extra`` values
    as outputs too."""
    proto = ir.to_proto(model)
    have = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra if n not in have)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise: equal float32 bit patterns, or both NaN."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


# --- the rounding ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 2.0**10, 3.0])
def test_rounding_equals_ml_dtypes_bit_for_bit(fmt: ir.DataType, scale: float) -> None:
    targets = value_classes(fmt)
    with np.errstate(over="ignore"):
        x = (targets / F32(scale)).astype(F32)
    model = one_product(Fp8(forward=fmt), len(x), step_graph=True)
    name = fmt.name.lower()
    # ORT hands E4M3 tensors to numpy as their uint8 bits; E5M2 ones not at all.
    outputs = [*([f"fp8/x/{name}"] if fmt == E4M3 else []), "fp8/x/fp8_value", "fp8/x/dequantized"]
    sess = session(model, outputs)
    feeds = {"x": x[:, None], "w": np.ones((1, 1), F32), "fp8/scales": np.array([scale, 1.0], F32)}  # x, w
    got = dict(zip(outputs, sess.run(outputs, feeds)))
    q, dq = ref_quantize(x, scale, fmt)
    bad = ~same_bits(got["fp8/x/fp8_value"].ravel(), q.astype(F32))
    assert not bad.any(), f"{bad.sum()} of {len(x)} differ, e.g. x*s={x[bad][:4] * F32(scale)} -> {got['fp8/x/fp8_value'].ravel()[bad][:4]}, ml_dtypes {q.astype(F32)[bad][:4]}"
    if fmt == E4M3:
        bits = got[f"fp8/x/{name}"].ravel()
        ok = (bits == q.view(np.uint8)) | (np.isnan(q.astype(F32)) & ((bits & 0x7F) == 0x7F))
        assert ok.all(), f"{(~ok).sum()} fp8 bit patterns differ"
    assert same_bits(got["fp8/x/dequantized"].ravel(), dq).all()
    # Every class occurs: ties rounded to even, subnormals kept, flushes, saturation, NaN.
    finfo = ml_dtypes.finfo(NUMPY[fmt])
    values = q.astype(F32)
    assert np.isnan(values).any() and (np.abs(values) == F32(finfo.max)).sum() > 4
    assert ((np.abs(values) < F32(finfo.smallest_normal)) & (values != 0)).any() and (values == 0).sum() > 4


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin,rounding", [(0, "pow2"), (2, "pow2"), (1, "none")])
def test_current_scale_equals_the_reference(fmt: ir.DataType, margin: int, rounding: str) -> None:
    fp8 = Fp8(forward=fmt, scaling=Fp8Scaling(recipe="current", margin=margin, rounding=rounding))
    model = one_product(fp8, 1, step_graph=False)
    record = json.loads(model.metadata_props[md.MODEL_FP8])
    assert record["recipe"]["used"] == "current" and record["tensors"][0]["scale"] is None
    sess = session(model, ["fp8/x/scale_new"])
    rng = np.random.default_rng(1)
    amaxes = [0.0, np.inf, np.nan, 1e-45, 1e-40, 1e-38, 3.4e38, 448.0, 449.0, 57344.0, 1.0, 0.75, 2.0**-20,
              *(2.0 ** rng.uniform(-40, 40, 60)), *(2.0 ** np.arange(-30, 30)),
              *(float(ml_dtypes.finfo(NUMPY[fmt]).max) * 2.0 ** np.arange(-40, 40))]  # ratios that are powers of two
    for amax in amaxes:
        for a in (F32(amax), np.nextafter(F32(amax), F32(0)), np.nextafter(F32(amax), F32(np.inf))):
            [scale] = sess.run(["fp8/x/scale_new"], {"x": np.array([[-a]], F32), "w": np.ones((1, 1), F32)})
            want = ref_scale(a, 1.0, fmt, margin, rounding)
            assert same_bits(scale, want), (a, scale, want)


# --- the delayed recipe ------------------------------------------------------------------------


def _tiny_step(policy: str) -> ir.Model:
    step = build_training_graph(ROOT / "models" / "onnx" / "tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05)
    return mpgraph.convert(step, parse_policy(policy, "p.yaml"), emulate=True)


@pytest.mark.parametrize("scaling", [
    "{recipe: delayed, history: 3, amax: max, margin: 0, rounding: pow2}",
    "{recipe: delayed, history: 1, amax: max, margin: 1, rounding: none}",
    "{recipe: delayed, history: 2, amax: most_recent, margin: 0, rounding: pow2}",
])
def test_delayed_state_matches_the_reference_step_for_step(scaling: str) -> None:
    settings = parse_policy(f"extends: fp8\nfp8: {{scaling: {scaling}}}", "p.yaml").fp8.scaling
    model = _tiny_step(f"extends: fp8\nfp8: {{scaling: {scaling}}}")
    record = json.loads(model.metadata_props[md.MODEL_FP8])
    tensors = record["tensors"]
    assert record["recipe"]["used"] == "delayed" and len(tensors) == 9  # x, 3 weights, 2 activations, 3 gradients
    assert sum(t["format"] == "float8e5m2" for t in tensors) == 3
    pairs = json.loads(model.metadata_props[md.MODEL_STATE_PAIRS])
    assert pairs[-2:] == [["fp8/scales", "fp8/scales/updated"], ["fp8/amax_history", "fp8/amax_history/updated"]]
    state = {a: model.graph.initializers[a].const_value.numpy() for a, _ in pairs}
    assert state["fp8/scales"].shape == (9,) and state["fp8/amax_history"].shape == (settings.history, 9)
    # What each tensor's amax reads (its first operand) and what that operand dequantises to.
    reads = {t["tensor"]: model.graph.node(f"fp8/{t['tensor']}/abs").inputs[0].name for t in tensors}
    extra = [*reads.values(), *(f"fp8/{t['tensor']}/dequantized" for t in tensors)]
    sess = session(model, extra)
    names = [o.name for o in sess.get_outputs()]
    ref = {t["tensor"]: (F32(1.0), np.zeros(settings.history, F32)) for t in tensors}
    rng = np.random.default_rng(0)
    for step in range(7):
        x = (rng.standard_normal((32, 4)) * 10.0 ** (step - 2)).astype(F32)  # amax from 0.03 to 300
        if step == 6:
            x[0, 0] = np.nan  # every amax NaN: pushed as 0, scales kept
        feeds = {**state, "x": x, "label": (x[:, 0] > 0).astype(np.int64)}
        out = dict(zip(names, sess.run(names, feeds)))
        for i, t in enumerate(tensors):
            key, fmt = t["tensor"], ir.DataType[t["format"].upper()]
            assert t["index"] == i
            scale, history = ref[key]
            operand = out[reads[key]]
            assert same_bits(state["fp8/scales"][i], scale), (step, key)  # the scale this step used ...
            assert same_bits(out[f"fp8/{key}/dequantized"], ref_quantize(operand, scale, fmt)[1]).all(), (step, key)
            amax = np.max(np.abs(operand))
            if step == 6 and key == "x":
                assert np.isnan(amax)
            amax = amax if np.isfinite(amax) else F32(0)
            history = np.concatenate([[amax], history[:-1]]).astype(F32)
            reduced = amax if settings.amax == "most_recent" else history.max()
            ref[key] = (ref_scale(reduced, scale, fmt, settings.margin, settings.rounding), history)
            assert same_bits(out["fp8/amax_history/updated"][:, i], history).all(), (step, key)
            assert same_bits(out["fp8/scales/updated"][i], ref[key][0]), (step, key, out["fp8/scales/updated"][i], ref[key][0])
        state = {a: out[b] for a, b in pairs}
    assert (out["fp8/amax_history/updated"][0] == 0).sum() >= 3  # x, relu and relu_1 pushed NaN as 0
    scales = [float(ref[t["tensor"]][0]) for t in tensors]
    assert len(set(scales)) > 3  # the scales moved, differently per tensor


def test_more_than_32_amaxes_are_pushed_through_concats_of_at_most_32_inputs() -> None:
    """ORT's CUDA Concat takes at most 32 inputs while a CUDA graph is captured: the zoo GPT's
    tensors (every product quantised: over 32) go into the history through a tree of Concats
    of at most 32, in tensor order, each this step's amax (one CPU step checks the row)."""
    step = build_training_graph(ROOT / "models" / "onnx" / "gpt.loss.onnx", optimizer="adamw", lr=3e-3)
    model = mpgraph.convert(step, "fp8", emulate=True, validate=False, calibrate=None)
    tensors = json.loads(model.metadata_props[md.MODEL_FP8])["tensors"]
    concats = [n for n in model.graph if n.op_type == "Concat"]
    assert len(tensors) > 32 and max(len(n.inputs) for n in concats) <= 32
    assert sum(n.name.startswith("fp8/amaxes") for n in concats) == 1 + -(-len(tensors) // 32)  # the groups and the root
    sess = session(model, [t["amax"] for t in tensors])
    names = [o.name for o in sess.get_outputs()]
    rng = np.random.default_rng(0)
    shapes = {i.name: [d if isinstance(d, int) else 2 for d in i.shape] for i in model.graph.inputs if i.name in ("tokens", "label")}
    feeds = {n: rng.integers(0, 64, s).astype(np.int64) for n, s in shapes.items()}
    state = {v.name: v.const_value.numpy() for v in model.graph.inputs if v.const_value is not None}
    out = dict(zip(names, sess.run(names, {**state, **feeds})))
    newest = out["fp8/amax_history/updated"][0]
    amaxes = np.array([out[t["amax"]] for t in tensors], F32)
    assert (amaxes > 0).all() and same_bits(newest, amaxes).all()


def test_fp8_state_is_checkpointed_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    from mpgraph.runtime.trainer import Trainer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4)).astype(F32)
    data = {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}
    model = _tiny_step("extends: fp8\nfp8: {scaling: {history: 4}}")
    whole = Trainer(model, provider="cpu", threads=1)
    whole.fit(data, steps=8, batch_size=32, seed=0)
    first = Trainer(model, provider="cpu", threads=1)
    first.fit(data, steps=4, batch_size=32, seed=0)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = Trainer(model, provider="cpu", threads=1)
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.fit(data, steps=4, batch_size=32, seed=0)
    fp8_state = [name for name in whole.state if name.startswith("fp8/")]
    assert sorted(fp8_state) == ["fp8/amax_history", "fp8/scales"]
    for name in fp8_state:
        assert np.array_equal(resumed.state[name], whole.state[name]), name
    assert (whole.state["fp8/amax_history"] > 0).all()  # 4 steps: every tensor's history is full


# --- the policy --------------------------------------------------------------------------------


def test_the_fp8_preset() -> None:
    policy = load_policy("fp8")
    assert policy.dtype == ir.DataType.BFLOAT16 and policy.loss_scaling.mode == "none"
    assert policy.ops == load_policy("bf16").ops  # every other op as in bf16
    assert policy.fp8 == Fp8(ops=("MatMul", "Gemm"), products="all", forward=E4M3, backward=E5M2,
                             scaling=Fp8Scaling("delayed", 1024, "max", 0, "pow2"))


@pytest.mark.parametrize("text,message", [
    ("fp8: {forward: e4m4}", "p.yaml:2: fp8.forward: invalid value 'e4m4' (did you mean 'e4m3'?); valid: float8e4m3fn, e4m3, float8e5m2, e5m2"),
    ("fp8: {ops: [Conv]}", "p.yaml:2: fp8.ops.0: invalid value 'Conv'; valid: MatMul, Gemm"),
    ("fp8: {scaling: {recipe: late}}", "p.yaml:2: fp8.scaling.recipe: invalid value 'late'; valid: delayed, current"),
    ("fp8: {scaling: {recip: delayed}}", "p.yaml:2: fp8.scaling.recip: unknown key (did you mean 'recipe'?); valid: recipe, history, amax, margin, rounding"),
    ("fp8: {scaling: {history: 0}}", "p.yaml:2: fp8.scaling.history: invalid value 0; expected an integer from 1 to 65536"),
    ("fp8: {scaling: {margin: 1.5}}", "p.yaml:2: fp8.scaling.margin: invalid value 1.5; expected an integer"),
    ("fp8: {scaling: {amax: mean}}", "p.yaml:2: fp8.scaling.amax: invalid value 'mean'; valid: max, most_recent"),
    ("fp8: {scaling: {rounding: up}}", "p.yaml:2: fp8.scaling.rounding: invalid value 'up'; valid: pow2, none"),
    ("fp8: {format: e4m3}", "p.yaml:2: fp8.format: unknown key (did you mean 'forward'?); valid: ops, products, forward, backward, scaling"),
    ("fp8: {products: linears}", "p.yaml:2: fp8.products: invalid value 'linears' (did you mean 'linear'?); valid: all, linear"),
])
def test_bad_fp8_sections_name_file_key_value_and_choices(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(f"extends: bf16\n{text}", "p.yaml")
    assert str(info.value) == message


def test_fp8_needs_a_low_dtype_and_can_be_turned_off() -> None:
    with pytest.raises(PolicyError, match=r"p.yaml:2: fp8: needs a low dtype"):
        parse_policy("dtype: float32\nfp8: {}", "p.yaml")
    assert parse_policy("extends: fp8\nfp8: false", "p.yaml").fp8 is None


# --- conversions -------------------------------------------------------------------------------


def test_inference_graph_uses_current_scaling_and_conversion_is_idempotent() -> None:
    model = mpgraph.convert(ROOT / "models" / "onnx" / "tiny_mlp.onnx", "fp8")
    assert model.opset_imports[""] == 19 and model.metadata_props[md.MODEL_OPSET_UPGRADED] == "18->19"
    record = json.loads(model.metadata_props[md.MODEL_FP8])
    assert record["recipe"]["used"] == "current"
    assert [t["tensor"] for t in record["tensors"]][:2] == ["x", "fc1.weight"]
    assert not any(v.name.startswith("fp8/") for v in model.graph.inputs)
    before = ir.to_proto(model).SerializeToString()
    again = mpgraph.convert(model, "fp8")
    assert ir.to_proto(again).SerializeToString() == before
    gemm = model.graph.node("node_linear")
    slots = json.loads(gemm.metadata_props[md.NODE_FP8])
    assert slots["0"] == {"tensor": "x", "format": "float8e4m3fn", "fp8": "fp8/x/float8e4m3fn",
                          "scale_inv": "fp8/x/scale_inv"}
    # Native lowering: the product reads the dequantised operand cast back to bfloat16.
    assert gemm.inputs[0].producer().op_type == "Cast" and gemm.inputs[0].dtype == ir.DataType.BFLOAT16


def test_no_opset_upgrade_is_refused_with_the_fix() -> None:
    with pytest.raises(mpgraph.MpgraphError, match="fp8: Cast to float8 needs opset 19, the model has opset 18; convert without"):
        mpgraph.convert(ROOT / "models" / "onnx" / "tiny_mlp.onnx", "fp8", upgrade_opset=False)


# --- audit -------------------------------------------------------------------------------------


def test_audit_lists_fp8_tensors_and_scales(tmp_path: Path) -> None:
    from mpgraph.audit import audit
    from tests.helpers import mpgraph_cli

    model = _tiny_step("extends: fp8\nfp8: {scaling: {history: 4}}")
    report = audit(model)
    assert report.fp8 is not None and report.fp8["recipe"]["used"] == "delayed"
    tensors = report.fp8["tensors"]
    assert tensors["fc1.weight"] == {"format": "float8e4m3fn", "kind": "forward", "scale": "fp8/scales[1]",
                                     "scale_value": 1.0, "history": 4, "gemms": ["node_linear"]}
    assert tensors["grad/node_relu/Mul"]["format"] == "float8e5m2"
    # The quantisation's nodes are counted apart, not as the model's float32 ops.
    assert report.fp8["nodes"] == sum(n.metadata_props.get(md.NODE_INSERTED) == "fp8" for n in model.graph) > 0
    assert sum(sum(c.values()) for ops in report.ops.values() for c in ops.values()) + report.fp8["nodes"] \
        + report.casts_inserted + report.rounds_inserted == len(model.graph)
    assert audit(mpgraph.convert(ROOT / "models" / "onnx" / "tiny_mlp.onnx", "bf16")).fp8 is None
    path = tmp_path / "step.onnx"
    ir.save(model, path)
    result = mpgraph_cli("audit", str(path))
    assert result.returncode == 0, result.stderr
    assert "fp8: 9 tensors (6 float8e4m3fn, 3 float8e5m2)" in result.stdout
    assert "scaling delayed (history 4, amax max, margin 0, rounding pow2)" in result.stdout


def test_audit_memory_counts_fp8_bytes() -> None:
    from mpgraph.audit.memory import estimate_memory

    report = estimate_memory(_tiny_step("extends: fp8"), batch=32)
    # tiny MLP 4-64-64-2, batch 32: operands x, relu, relu_1 (32x4, 32x64, 32x64), the weights
    # (64x4, 64x64, 2x64) and the gradients dlogits, drelu_1, drelu (32x2, 32x64, 32x64), a byte each.
    operands = 32 * 4 + 32 * 64 * 2 + 64 * 4 + 64 * 64 + 2 * 64 + 32 * 2 + 32 * 64 * 2
    assert report.fp8_bytes == {"values": operands, "state": 9 * 4 * (1 + 1024)}
    assert report.other_state_bytes >= report.fp8_bytes["state"]
    assert estimate_memory(build_training_graph(ROOT / "models" / "onnx" / "tiny_mlp.loss.onnx"), batch=32).fp8_bytes == {}


def test_compare_runs_on_fp8_step_graphs() -> None:
    from mpgraph.audit.compare_train import compare_train

    reference = build_training_graph(ROOT / "models" / "onnx" / "tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05)
    candidate = mpgraph.convert(reference.clone(), "fp8", emulate=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype(F32)
    report = compare_train(reference, candidate, {"x": x, "label": (x[:, 0] > 0).astype(np.int64)})
    assert 0 < report.loss_rel_error < 0.05 and len(report.gradients) == 6
    # The first product whose operands were quantised (at scale 1: the initial state) diverges first.
    assert report.first_divergence is not None and report.first_divergence.producer == "Gemm 'node_linear'"
    assert report.first_backward_divergence is not None and report.first_backward_divergence.precision == "bfloat16"
    assert [t.tensor for t in report.fp8][:2] == ["x", "fc1.weight"] and len(report.fp8) == 9
    # Scales that make x saturate and fc1.weight flush to zero: the shares are numpy's.
    scales = np.ones(9, F32)
    scales[:2] = [2.0**12, 2.0**-12]
    candidate.graph.initializers["fp8/scales"].const_value = ir.tensor(scales, name="fp8/scales")
    report = compare_train(reference, candidate, {"x": x, "label": (x[:, 0] > 0).astype(np.int64)})
    w = reference.graph.initializers["fc1.weight"].const_value.numpy()
    stats = {t.tensor: t for t in report.fp8}
    assert (stats["x"].scale, stats["x"].entries) == (4096.0, x.size)
    assert stats["x"].saturated == np.mean(np.abs(x) * 4096 > 448) > 0.9
    assert stats["fc1.weight"].flushed == np.mean(ref_quantize(w, 2.0**-12, E4M3)[0].astype(F32) == 0) > 0.9
    assert stats["relu"].saturated == stats["relu"].flushed == 0


def test_boundary_casts_are_quantised_from_float32_and_low_values_as_they_are() -> None:
    model = _tiny_step("extends: fp8")

    def amax_reads(key: str) -> ir.Value:
        return model.graph.node(f"fp8/{key}/abs").inputs[0]

    # Master weights and the float32 input: one rounding, float32 -> fp8 (not via bfloat16).
    assert [amax_reads(k).name for k in ("x", "fc1.weight", "fc2.weight")] == ["x", "fc1.weight", "fc2.weight"]
    # relu runs in bfloat16 (emulated: float32 rounded to bfloat16): quantised from that rounding.
    relu = amax_reads("relu").producer()
    assert relu is not None and relu.op_type == "Cast" and relu.metadata_props[md.NODE_INSERTED] == "round"


def test_linear_products_only_quantise_layers_with_weights_and_their_backward() -> None:
    step = build_training_graph(ROOT / "models" / "onnx" / "gpt.loss.onnx", optimizer="adamw", lr=3e-3)
    model = mpgraph.convert(step, parse_policy("extends: fp8\nfp8: {products: linear}", "p.yaml"), emulate=True)
    quantised = {n.name for n in model.graph if md.NODE_FP8 in n.metadata_props}
    products = {n.name: n for n in model.graph if n.op_type in ("MatMul", "Gemm") and md.NODE_INSERTED not in n.metadata_props}
    forward = {name for name in quantised if products[name].metadata_props.get(md.NODE_ROLE) == md.Role.FORWARD}
    # 2 blocks x (qkv, proj, fc, out) + head: the attention products Q K^T and P V are left alone.
    assert len(forward) == 9 and not any(name.startswith("node_matmul") for name in forward)
    backward = quantised - forward
    assert backward == {n for n, node in products.items() if node.metadata_props.get(md.NODE_GRAD_OF) in forward}
    assert len(backward) == 18  # dX and dW of each
    tensors = json.loads(model.metadata_props[md.MODEL_FP8])["tensors"]
    assert sum(t["kind"] == "gradient" for t in tensors) == 9 and sum(t["tensor"].endswith("weight") for t in tensors) == 9


def test_the_trainer_runs_the_rounding_the_reference_checks() -> None:
    """The trainer's session (its kernels, its options) ends 3 steps with the state of the plain
    session that test_delayed_state_matches_the_reference_step_for_step checks, bit for bit."""
    from mpgraph.runtime.trainer import Trainer

    model = _tiny_step("extends: fp8\nfp8: {scaling: {history: 4}}")
    pairs = json.loads(model.metadata_props[md.MODEL_STATE_PAIRS])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype(F32)
    batch = {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}
    trainer = Trainer(model, provider="cpu", threads=1)
    sess = session(model, [])
    names = [o.name for o in sess.get_outputs()]
    state = {a: model.graph.initializers[a].const_value.numpy() for a, _ in pairs}
    for _ in range(3):
        trainer.step(batch)
        out = dict(zip(names, sess.run(names, {**state, **batch})))
        state = {a: out[b] for a, b in pairs}
    assert all(np.array_equal(state[a], trainer.state[a]) for a in state), [a for a in state if not np.array_equal(state[a], trainer.state[a])]
    assert not np.array_equal(state["fp8/scales"], np.ones(9, F32))


def test_a_users_input_named_like_the_fp8_state_is_refused() -> None:
    x = onnx.helper.make_tensor_value_info("fp8/scales", onnx.TensorProto.FLOAT, [2, 2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["fp8/scales", "fp8/scales"], ["y"], name="allow1")],
                                   "g", [x], [y])
    model = ir.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 19)], ir_version=9))
    model.graph.node("allow1").metadata_props[md.NODE_PRECISION] = "bfloat16"
    model.metadata_props.update({md.MODEL_TRAINING: "true", md.MODEL_STATE_PAIRS: "[]"})
    with pytest.raises(mpgraph.MpgraphError, match="fp8: the step graph has an input named 'fp8/scales', but it is not fp8 state"):
        QuantizeFp8Pass(Fp8(), ir.DataType.BFLOAT16)(model)
