"""Loss scaling inside the step graph: underflow, overflow skip, GradScaler's scale sequence."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import mpgraph
from models.underflow import underflow_model
from mpgraph._ir import meta as md
from mpgraph.policy import parse_policy
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner


def tiny_gradient_model() -> ir.Model:
    """Gradients ~1e-8 through a 16x4 MatMul (models/underflow.py), as an SGD step graph."""
    return build_training_graph(underflow_model(16, 4), optimizer="sgd", lr=1.0)


def sgd_gradient(step: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """One SGD step with lr=1 from W=0: the new W is exactly -grad."""
    runner = CpuRunner(step)
    runner.step(feeds, lr=1.0)
    return -runner.state["W"]


def policy(text: str):
    return parse_policy(text, "test.yaml")


def test_fp16_underflow_without_scaling_and_recovery_with_dynamic_scaling():
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((8, 16)).astype(np.float32), "t": rng.standard_normal((8, 4)).astype(np.float32)}
    step = tiny_gradient_model()
    ref = sgd_gradient(step, feeds)
    assert 1e-10 < np.abs(ref).mean() < 1e-7  # the gradients really are ~1e-8
    unscaled = mpgraph.convert(tiny_gradient_model(), policy("extends: fp16\nloss_scaling: {mode: none}\n"), emulate=True)
    lost = sgd_gradient(unscaled, feeds)
    zero_fraction = float(np.mean(lost == 0))
    print(f"fp16 without loss scaling: {zero_fraction:.1%} of gradients are zero")
    assert zero_fraction > 0.9
    scaled = mpgraph.convert(tiny_gradient_model(), "fp16", emulate=True)
    assert md.LOSS_SCALE in {v.name for v in scaled.graph.inputs}
    got = sgd_gradient(scaled, feeds)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=1e-3 * np.abs(ref).max())
    bf16 = mpgraph.convert(tiny_gradient_model(), "bf16", emulate=True)
    assert md.LOSS_SCALE not in {v.name for v in bf16.graph.inputs}
    np.testing.assert_allclose(sgd_gradient(bf16, feeds), ref, rtol=5e-2, atol=1e-2 * np.abs(ref).max())


def _step_model(growth_interval: int) -> ir.Model:
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adam")
    pol = policy(f"extends: fp16\nloss_scaling: {{mode: dynamic, init: 1024, growth_interval: {growth_interval}}}\n")
    return mpgraph.convert(step, pol, emulate=True)


def _batch(bad: bool) -> dict[str, np.ndarray]:
    """A fixed batch per kind (seeded per call, so no test depends on another having run)."""
    rng = np.random.default_rng(1 if bad else 0)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    if bad:
        x[0, 0] = np.inf
    return {"x": x, "label": rng.integers(0, 2, 6).astype(np.int64)}


def _assert_overflow_skips(trainer: Trainer) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A finite step, then an overflowing one: the second is skipped, leaves every state but the
    scale bit-identical, halves the scale and resets the growth tracker. Returns the states
    before and after the skipped step."""
    assert not trainer.step(_batch(False), lr=1e-3).skipped
    before = trainer.state
    assert trainer.step(_batch(True), lr=1e-3).skipped
    after = trainer.state
    for name, value in before.items():
        if name in (md.LOSS_SCALE, md.GROWTH_TRACKER):
            continue
        assert np.array_equal(after[name], value), name
    assert float(after[md.LOSS_SCALE]) == float(before[md.LOSS_SCALE]) * 0.5
    assert float(after[md.GROWTH_TRACKER]) == 0.0
    return before, after


def test_overflow_skips_step_bit_identical_and_halves_scale():
    _assert_overflow_skips(Trainer(_step_model(growth_interval=2000), provider="cpu"))


def test_scale_sequence_equals_torch_gradscaler():
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    interval = 3
    trainer = Trainer(_step_model(growth_interval=interval), provider="cpu")
    ours = []
    for bad in pattern:
        assert trainer.step(_batch(bad), lr=1e-3).skipped == bad
        ours.append(float(np.asarray(trainer.state[md.LOSS_SCALE]).reshape(())))
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=interval)
    theirs = []
    for bad in pattern:
        optimizer.zero_grad()
        scaler.scale((param * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        theirs.append(float(scaler.get_scale()))
    assert ours == theirs


def test_training_graph_policy_roles():
    step = build_training_graph("models/onnx/gpt.loss.onnx", optimizer="adamw")
    m = mpgraph.convert(step, "bf16")
    by_role: dict[str, dict[str, int]] = {}
    for node in m.graph:
        role = node.metadata_props.get(md.NODE_ROLE)
        precision = node.metadata_props.get(md.NODE_PRECISION)
        if role and precision:
            by_role.setdefault(role, {}).setdefault(precision, 0)
            by_role[role][precision] += 1
    assert by_role["optimizer"].get("bfloat16", 0) == 0
    assert by_role["backward"].get("bfloat16", 0) > 0
    low_backward = {n.op_type for n in m.graph if n.metadata_props.get(md.NODE_ROLE) == "backward"
                    and n.metadata_props.get(md.NODE_PRECISION) == "bfloat16"}
    assert "MatMul" in low_backward or "Gemm" in low_backward
    reasons = {n.metadata_props.get(md.NODE_REASON, "") for n in m.graph}
    assert any(r.startswith("backward of deny op LayerNormalization") for r in reasons)
    assert any(r.startswith("backward of deny op Softmax") for r in reasons)
    # Parameters and state stay float32 graph inputs/outputs.
    pairs = json.loads(m.metadata_props[md.MODEL_STATE_PAIRS])
    inputs = {v.name: v for v in m.graph.inputs}
    outputs = {v.name: v for v in m.graph.outputs}
    for state_in, state_out in pairs:
        assert inputs[state_in].dtype == ir.DataType.FLOAT
        assert outputs[state_out].dtype == ir.DataType.FLOAT


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_loss_scaling_modes_build(mode):
    pol = policy(f"extends: fp16\nloss_scaling: {{mode: {mode}, init: 256}}\n")
    m = mpgraph.convert(build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd"), pol, emulate=True)
    names = {v.name for v in m.graph.inputs}
    assert (md.LOSS_SCALE in names) == (mode == "dynamic")
    assert md.FOUND_INF in {v.name for v in m.graph.outputs}
    again = mpgraph.convert(m, pol, emulate=True)
    assert ir.to_proto(again).SerializeToString() == ir.to_proto(m).SerializeToString()


ZOO_STEP_MODELS = ["tiny_mlp", "wide_mlp", "dqn_cnn", "gpt", "resnet"]


@functools.cache
def _adamw_step(name: str) -> bytes:
    """The zoo model's AdamW step graph, built once per process for the four presets."""
    return ir.to_proto(build_training_graph(f"models/onnx/{name}.loss.onnx", optimizer="adamw")).SerializeToString()


@pytest.mark.parametrize("preset", ["fp16", "bf16", "torch-autocast", "tf-amp"])
@pytest.mark.parametrize("name", ZOO_STEP_MODELS)
def test_zoo_step_graph_converts_natively(name, preset):
    """Native (not emulated) low-precision step graphs pass the full checker and strict
    inference (convert validates). A ReLU's backward compares its low-precision input with 0:
    both operands of the comparison get one dtype (it once compared an fp16 value with an fp32
    zero)."""
    m = mpgraph.convert(ir.from_proto(onnx.load_from_string(_adamw_step(name))), preset)
    for node in m.graph:
        if node.op_type == "Greater" and node.metadata_props.get(md.NODE_ROLE) == "backward":
            dtypes = {v.dtype for v in node.inputs}
            assert len(dtypes) == 1, (node.name, dtypes)
    if name == "tiny_mlp" and preset in ("fp16", "bf16"):
        # fp16: lowered with its input; bf16: float32 (ORT 1.31 CUDA has no bfloat16 Greater).
        want = "float16" if preset == "fp16" else "float32"
        relu_masks = [n for n in m.graph if n.op_type == "Greater" and n.name.startswith("grad/")]
        assert relu_masks and all(n.metadata_props[md.NODE_PRECISION] == want for n in relu_masks)


def test_flat_optimizer_overflow_skips_step_bit_identical_and_halves_scale():
    """The same as the per-tensor test above, with the flat optimizer: the skip guards the
    flat parameter before its Split and the flat moments, not every parameter."""
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adam", optimizer_options={"flat": True})
    pol = policy("extends: fp16\nloss_scaling: {mode: dynamic, init: 1024, growth_interval: 2000}\n")
    model = mpgraph.convert(step, pol, emulate=True)
    checks = [n for n in model.graph if n.op_type == "ReduceSum" and n.metadata_props.get(md.NODE_ROLE) == "optimizer"]
    assert len(checks) == 1
    trainer = Trainer(model, provider="cpu")
    before, after = _assert_overflow_skips(trainer)
    assert {"optim/flat/m", "optim/flat/v", "fc1.weight"} <= set(before)
    assert not trainer.step(_batch(False), lr=1e-3).skipped
    assert not np.array_equal(trainer.state["fc1.weight"], after["fc1.weight"])


def test_loss_scaling_refuses_a_step_graph_without_roles():
    """Without node roles the pass cannot tell what to guard, and a skipped step would still
    apply its update: it refuses (onnx.version_converter, run by convert's opset upgrade,
    drops node metadata)."""
    from mpgraph.errors import MpgraphError
    from mpgraph.passes.scale_loss import ScaleLossPass

    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adam")
    for node in step.graph:
        node.metadata_props.pop(md.NODE_ROLE, None)
    settings = policy("extends: fp16\nloss_scaling: {mode: dynamic}\n").loss_scaling
    with pytest.raises(MpgraphError, match="optimizer role"):
        ScaleLossPass(settings)(step)


def test_audit_reports_the_loss_scaling_settings() -> None:
    """``mpgraph.loss_scaling`` (the policy's settings) is read back by the audit, only for a
    step graph that loss scaling rewrote."""
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adam")
    scaled = mpgraph.audit(mpgraph.convert(step, policy("extends: fp16\nloss_scaling: {mode: dynamic, init: 1024}\n"), emulate=True))
    assert scaled.loss_scaling is not None and scaled.loss_scaling["mode"] == "dynamic" and scaled.loss_scaling["init"] == 1024
    unscaled = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adam")
    assert mpgraph.audit(mpgraph.convert(unscaled, "bf16", emulate=True)).loss_scaling is None
