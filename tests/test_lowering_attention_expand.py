"""The ``attention_expand`` lowering rule (``mpgraph/lowering/attention_expand.py``).

ORT CPU has an ``Attention`` kernel, so one-node graphs run as ORT's Attention and, after the
rule, as its standard ops, both on ORT CPU; a float32 step graph's loss and gradients likewise.
The bfloat16 expansion (no CPU kernels) is checked by structure, and the CUDA rule list (as
``plan.py`` applies it) on bf16 and float32 steps: with cuDNN attention every Attention is fused,
without it every one is expanded.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import mpgraph
from mpgraph.lowering.match import emulated
from mpgraph.lowering.registry import RULES, Target
from mpgraph.targets import check_runnable
from mpgraph.training import build_training_graph
from tests.test_lowering_attention import _assert_in_order, _block

RULE = next(r for r in RULES if r.name == "attention_expand")
CUDA = Target("cuda", "native")
F32, BF16 = ir.DataType.FLOAT, ir.DataType.BFLOAT16

CASES = {  # (B, Hq, Hkv, Sq, Skv, D, Dv, 3-D, mask: None | "float" | "bool", attributes)
    "mha-4d-causal": (2, 2, 2, 5, 5, 8, 8, False, None, {"is_causal": 1}),
    "gqa-3d-causal": (2, 4, 2, 6, 6, 4, 4, True, None, {"is_causal": 1}),
    "float-mask-causal": (1, 2, 2, 4, 4, 8, 8, False, "float", {"is_causal": 1}),
    "bool-mask-gqa-3d": (2, 4, 1, 5, 5, 4, 6, True, "bool", {}),
    "softcap-causal": (1, 2, 2, 6, 6, 4, 4, False, None, {"is_causal": 1, "softcap": 2.0}),
    "explicit-scale-cross": (1, 3, 3, 3, 7, 4, 6, False, None, {"scale": 0.3}),
}


def _inputs(case: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b, hq, hkv, sq, skv, d, dv, three, mask, _ = CASES[case]
    arrays = {"q": rng.standard_normal((b, hq, sq, d)), "k": rng.standard_normal((b, hkv, skv, d)),
              "v": rng.standard_normal((b, hkv, skv, dv))}
    if three:
        arrays = {n: a.transpose(0, 2, 1, 3).reshape(b, a.shape[2], -1) for n, a in arrays.items()}
    feeds = {n: (2 * a).astype(np.float32) for n, a in arrays.items()}
    if mask == "float":
        feeds["mask"] = rng.standard_normal((sq, skv)).astype(np.float32)
    elif mask == "bool":
        feeds["mask"] = rng.random((b, 1, sq, skv)) < 0.6
        feeds["mask"][:, :, :, 0] = True  # every query keeps a key (test_fully_masked_rows_are_zero: none)
    return feeds


def _model(case: str, feeds: dict[str, np.ndarray], dtype: int = TensorProto.FLOAT, dynamic: bool = False,
           **extra) -> onnx.ModelProto:
    b, hq, hkv, sq, _, _, dv, three, _, attrs = CASES[case]
    heads = {"q_num_heads": hq, "kv_num_heads": hkv} if three else {}
    node = helper.make_node("Attention", list(feeds), ["y"], name="attn", **heads, **attrs, **extra)

    def info(name: str, a: np.ndarray) -> onnx.ValueInfoProto:
        kind = TensorProto.BOOL if a.dtype == bool else dtype
        shape: list = list(a.shape)
        if dynamic and name != "mask":  # batch and sequence dims symbolic; heads, head dims static
            shape[0], shape[1 if three else 2] = "batch", f"seq_{name}"
        return helper.make_tensor_value_info(name, kind, shape)

    graph = helper.make_graph([node], "attention", [info(n, a) for n, a in feeds.items()],
                              [helper.make_tensor_value_info("y", dtype, [b, sq, hq * dv] if three else [b, hq, sq, dv])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(model: onnx.ModelProto | ir.Model, feeds: dict) -> list[np.ndarray]:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", CASES)
def test_expansion_matches_ort_attention(case: str, dynamic: bool) -> None:
    """The expansion on ORT CPU against ORT CPU's own Attention kernel (within 1e-6); dynamic
    sequence lengths take the ConstantOfShape/Trilu causal bias instead of a constant."""
    feeds = _inputs(case, np.random.default_rng(0))
    proto = _model(case, feeds, dynamic=dynamic)
    model = ir.from_proto(proto)
    assert RULE.apply(model, CUDA) == 1
    ops = _ops(model)
    assert "Attention" not in ops and ops["Softmax"] == 1 and ops["ReduceMax"] == int(CASES[case][8] is not None)
    assert ("Trilu" in ops) == (dynamic and CASES[case][9].get("is_causal") == 1), ops
    _assert_in_order(model)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    (want,), (got,) = _run(proto, feeds), _run(model, feeds)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-6, np.abs(got - want).max()


def test_fully_masked_rows_are_zero() -> None:
    """A query whose every key is masked gets a zero row (the spec's errata), as from ORT
    CPU's kernel, not the NaN of a softmax over ``-inf`` alone."""
    case = "bool-mask-gqa-3d"
    feeds = _inputs(case, np.random.default_rng(1))
    feeds["mask"][0, 0, 2] = False
    model = ir.from_proto(_model(case, feeds))
    RULE.apply(model, CUDA)
    (got,), (want,) = _run(model, feeds), _run(_model(case, feeds), feeds)
    assert not got[0, 2].any() and np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-6


def test_scale_is_split_over_q_and_k_as_the_function_body_does() -> None:
    """One constant ``float32(sqrt(scale))`` multiplies Q and K (two Muls), rounded to the
    node's dtype (bfloat16 here) as the body's ``ScaleFactorF``."""
    case = "mha-4d-causal"
    model = ir.from_proto(_model(case, _inputs(case, np.random.default_rng(0)), TensorProto.BFLOAT16))
    RULE.apply(model, CUDA)
    muls = [n for n in model.graph if n.op_type == "Mul"]
    assert len(muls) == 2 and muls[0].inputs[1] is muls[1].inputs[1]
    root = muls[0].inputs[1].const_value
    want = np.sqrt(np.float32(1) / np.sqrt(np.float32(8))).astype(BF16.numpy())
    assert root.dtype == BF16 and root.numpy() == want


def _dtypes(model: ir.Model, op: str) -> list[tuple]:
    return [(tuple(v.dtype for v in n.inputs if v is not None), n.outputs[0].dtype) for n in model.graph if n.op_type == op]


def test_bf16_expansion_stays_in_bf16_with_a_float32_bias_for_a_mask() -> None:
    """Structure of a bfloat16 node: products, scores and the Softmax's I/O in bfloat16 (its
    kernel computes in float32); the boolean mask's bias and the row guard's ReduceMax in
    float32 (ORT CUDA has no bfloat16 ReduceMax), the bias rounded once; no other Cast."""
    case = "bool-mask-gqa-3d"
    model = ir.from_proto(_model(case, _inputs(case, np.random.default_rng(0)), TensorProto.BFLOAT16))
    assert RULE.apply(model, CUDA) == 1
    assert _dtypes(model, "MatMul") == [((BF16, BF16), BF16)] * 2
    assert _dtypes(model, "Softmax") == [((BF16,), BF16)]
    assert _dtypes(model, "Cast") == [((F32,), BF16)]
    assert _dtypes(model, "ReduceMax") == [((F32, ir.DataType.INT64), F32)]
    wheres = _dtypes(model, "Where")
    assert wheres == [((ir.DataType.BOOL, F32, F32), F32), ((ir.DataType.BOOL, BF16, BF16), BF16)]
    assert all(n.metadata_props.get("mpgraph.precision") is None for n in model.graph)  # none recorded here


def test_softmax_precision_casts_around_the_softmax() -> None:
    case = "softcap-causal"
    model = ir.from_proto(_model(case, _inputs(case, np.random.default_rng(0)), TensorProto.BFLOAT16,
                                 softmax_precision=TensorProto.FLOAT))
    RULE.apply(model, CUDA)
    assert _dtypes(model, "Softmax") == [((F32,), F32)]
    assert _dtypes(model, "Cast") == [((BF16,), F32), ((F32,), BF16)]
    assert _dtypes(model, "Tanh") == [((BF16,), BF16)]


def test_cpu_and_what_the_rule_leaves_alone(caplog: pytest.LogCaptureFixture) -> None:
    case = "mha-4d-causal"
    feeds = _inputs(case, np.random.default_rng(0))
    model = ir.from_proto(_model(case, feeds))
    before = ir.to_proto(model).SerializeToString()
    assert RULE.apply(model, Target("cpu", "native")) == 0 and not RULE.runs("cpu", "all")
    assert ir.to_proto(model).SerializeToString() == before
    cache = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "present_k", "present_v"], name="attn")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2, 5, 8]) for n in ("q", "k", "v", "pk", "pv")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "present_k", "present_v")]
    graph = helper.make_graph([cache], "cache", inputs, outputs)
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    with caplog.at_level(logging.WARNING, logger="mpgraph.lowering.attention_expand"):
        assert RULE.apply(model, CUDA) == 0
    assert "'attn' left alone: a KV cache" in caplog.text


# -- step graphs ---------------------------------------------------------------------------------

def test_float32_step_graph_expanded_matches_the_unexpanded_one() -> None:
    """Loss and every gradient of the 3-D GQA causal block, on ORT CPU, with its Attention as
    ORT's kernel and as the expansion (the backward block is the gradient rule's either way)."""
    step = build_training_graph(_block((4, 2)), optimizer=None, canonicalize=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 6, 16)).astype(np.float32)}
    proto = ir.to_proto(step)
    names = [o.name for o in proto.graph.output]
    assert RULE.apply(step, CUDA) == 1 and "Attention" not in _ops(step)
    _assert_in_order(step)
    for name, want, got in zip(names, _run(proto, feeds), _run(step, feeds), strict=True):
        assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(want).max()), name


def _cuda_rules(model: ir.Model, sdpa: bool) -> dict[str, int]:
    """The rules ``plan.py`` applies for a CUDA session (scope ``default``), as it applies them."""
    target = Target(provider="cuda", scope="default", sdpa=sdpa)
    return {r.name: r.apply(model, target) for r in RULES if r.runs(target.provider, target.scope)}


@pytest.mark.parametrize(("policy", "sdpa", "mask", "fused", "expanded"), [
    ("bf16", True, False, 1, 0), ("bf16", False, False, 0, 1), ("fp32", True, False, 0, 1), ("bf16", True, True, 0, 1),
    ("fp16", False, True, 0, 1)])
def test_cuda_rules_fuse_or_expand_every_attention(policy: str, sdpa: bool, mask: bool, fused: int, expanded: int) -> None:
    """A canonicalised step's Attention (head dim 8) is fused with cuDNN attention in bf16 and
    expanded otherwise (no cuDNN, float32, a mask): no Attention is left for ORT CUDA to miss.
    Each op of the expansion records the precision it computes in (none looks emulated, and
    the CUDA kernel table has each)."""
    step = build_training_graph(_block((2, 1), mask=mask), optimizer="adamw", canonicalize=True)
    step = mpgraph.convert(step, policy, target="cuda")
    applied = _cuda_rules(step, sdpa)
    assert (applied["sdpa"], applied["attention_expand"]) == (fused, expanded)
    ops = _ops(step)
    assert "Attention" not in ops and ops["SdpaForward"] == fused
    _assert_in_order(step)
    check_runnable(step, "cuda")
    if expanded:
        made = [n for n in step.graph if n.name.startswith("attn/")]
        assert len(made) >= 6 and not any(emulated(*n.outputs) for n in made)
        softmax = [n for n in step.graph if n.op_type == "Softmax" and n.metadata_props.get("mpgraph.role") == "forward"]
        low = {"bf16": BF16, "fp16": ir.DataType.FLOAT16, "fp32": F32}[policy]
        assert len(softmax) == 1 and softmax[0].outputs[0].dtype == low
        assert softmax[0].metadata_props["mpgraph.precision"] == {"bf16": "bfloat16", "fp16": "float16"}.get(policy, "float32")


def test_a_cuda_plan_without_the_kernel_library_still_expands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the library cannot be built, a CUDA plan still runs the rules onto ORT's own ops
    (scope ``native``): the Attention is expanded, not left to ORT's kernel on the CPU provider."""
    from mpgraph.lowering import KernelBuildError, PlanOptions, plan, plan_session

    def no_library(provider: str):
        raise KernelBuildError("no nvcc here")

    monkeypatch.setattr(plan, "library", no_library)
    step = mpgraph.convert(build_training_graph(_block((2, 1)), optimizer="adamw", canonicalize=True), "bf16",
                           target="cuda")
    session = plan_session(step, "cuda", PlanOptions())
    assert (session.scope, session.custom_ops, session.kernels_reason) == ("native", None, "no nvcc here")
    assert dict(session.applied)["attention_expand"] == 1
    assert "Attention" not in _ops(ir.from_proto(onnx.load_from_string(session.graph)))
    assert session.unfused_attention == 1 and session.attention_reason == "no kernel library (no nvcc here)"


def test_a_cuda_plan_whose_library_lacks_the_fused_attention_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A library built without cuDNN's headers (the CPU build stands in: no MpgraphKernelsHaveSdpa)
    leaves the Attention written out; the plan says how many and why, and warns once, naming
    `mpgraph kernels`. On CPU nothing is said: ORT's Attention is the plan there."""
    from mpgraph.lowering import PlanOptions, plan, plan_session

    cpu_library = plan.library("cpu")
    monkeypatch.setattr(plan, "library", lambda provider: cpu_library)
    monkeypatch.setenv("MPGRAPH_CUDA_LIBRARY", str(cpu_library))  # so the reason is the library's, not this machine's headers
    step = mpgraph.convert(build_training_graph(_block((2, 1)), optimizer="adamw", canonicalize=True), "bf16",
                           target="cuda")
    plan._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="mpgraph.lowering.plan"):
        session = plan_session(step, "cuda", PlanOptions())
    assert session.custom_ops == str(cpu_library) and session.unfused_attention == 1
    assert session.attention_reason == "the kernel library has no fused attention (built without it)"
    assert [r.getMessage() for r in caplog.records].count(
        "1 Attention(s) run unfused on CUDA, their scores written out (about 2x the step time and memory on GPT-2 "
        "small): the kernel library has no fused attention (built without it); `mpgraph kernels` says what the "
        "library has") == 1
    assert plan_session(step, "cpu", PlanOptions(kernels=False)).unfused_attention == 0
    # A library with the fused attention, whose rule does not take this Attention's form.
    from mpgraph.lowering import registry

    monkeypatch.setattr(plan, "has_sdpa", lambda path: True)
    monkeypatch.setattr(registry, "fuse_attention", lambda model, provider: 0)
    session = plan_session(step, "cuda", PlanOptions())
    assert session.unfused_attention == 1
    assert session.attention_reason == "the fused attention does not take their form (mask, layout or type)"


def test_a_float32_step_says_its_attention_is_float32_and_does_not_warn(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """cuDNN's fused attention takes float16 and bfloat16 only, so a float32 (or TF32) step's
    Attentions are written out on CUDA whatever the library holds: the plan says so, with no
    warning (the bench GPT's fp32 and tf32 rows printed "about 2x the step time" before)."""
    from mpgraph.lowering import PlanOptions, plan, plan_session

    cpu_library = plan.library("cpu")
    monkeypatch.setattr(plan, "library", lambda provider: cpu_library)
    monkeypatch.setattr(plan, "has_sdpa", lambda path: True)
    step = build_training_graph(_block((2, 1)), optimizer="adamw", canonicalize=True)
    plan._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="mpgraph.lowering.plan"):
        session = plan_session(step, "cuda", PlanOptions())
    assert session.unfused_attention == 1 and session.attention_reason.startswith("float32 attention")
    assert not caplog.records


def test_cuda_evaluation_plan_writes_attention_out() -> None:
    """An evaluation session on CUDA gets the forward part with its Attention written out (ORT
    CUDA lacks many Attention configurations and ORT CPU has no bfloat16 one); the CPU plan
    keeps ORT's own Attention. Both compute the same logits on ORT CPU (float32 step)."""
    from mpgraph.lowering.plan import PlanOptions, plan_session

    step = build_training_graph(_block((4, 2)), optimizer=None, canonicalize=True)
    target = next(n.outputs[0].name for n in step.graph if n.op_type == "Attention")
    plans = {p: plan_session(step, p, PlanOptions(forward_of=target)) for p in ("cuda", "cpu")}
    ops = {p: Counter(n.op_type for n in onnx.load_from_string(plan.graph).graph.node) for p, plan in plans.items()}
    assert ops["cuda"]["Attention"] == 0 and ops["cpu"]["Attention"] == 1
    assert dict(plans["cuda"].applied) == {"attention_expand": 1}
    x = np.random.default_rng(3).standard_normal((2, 6, 16)).astype(np.float32)
    got, want = (_run(onnx.load_from_string(plans[p].graph), {"x": x})[0] for p in ("cuda", "cpu"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
