"""audit --memory: bytes per parameter by role (the 14-byte lesson) and activations by liveness."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from onnx import helper as h
from typer.testing import CliRunner

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.audit.memory import estimate_memory, ort_order
from mpgraph.cli.main import app
from tests.helpers import init, make_model, vi

TINY = "models/onnx/tiny_mlp.loss.onnx"  # 4-64-64-2, every parameter in a Gemm (4,610 of them)


def step(optimizer: str, policy: str | None = None):
    graph = mpgraph.build_training_graph(TINY, optimizer=optimizer)
    return graph if policy is None else mpgraph.convert(graph, policy)


def test_bf16_adamw_is_14_bytes_per_parameter_before_gradients_and_activations():
    """bf16 weights (2) + fp32 master (4) + Adam's m and v (4 + 4): the lesson's 14 bytes."""
    report = estimate_memory(step("adamw", "bf16"), batch=64)
    per = report.bytes_per_parameter
    assert report.parameters == 4 * 64 + 64 + 64 * 64 + 64 + 64 * 2 + 2
    assert (per["low_weights"], per["master_weights"], per["optimizer_state"]) == (2.0, 4.0, 8.0)
    assert per["low_weights"] + per["master_weights"] + per["optimizer_state"] == 14.0
    # The optimizer reads bf16 gradients, and fp32 ones for the output bias (next to the fp32 loss).
    assert 2.0 < per["gradients"] < 2.1  # measured 2.0009 (the output layer's 2 bias elements are float32)


@pytest.mark.parametrize(("optimizer", "policy", "expected"), [
    ("adamw", None, {"low_weights": 0.0, "master_weights": 4.0, "gradients": 4.0, "optimizer_state": 8.0}),
    ("sgd", "bf16", {"low_weights": 2.0, "master_weights": 4.0, "optimizer_state": 0.0}),
    ("adam", "fp16", {"low_weights": 2.0, "master_weights": 4.0, "optimizer_state": 8.0}),
])
def test_roles_follow_the_policy_and_optimizer(optimizer, policy, expected):
    per = estimate_memory(step(optimizer, policy), batch=8).bytes_per_parameter
    assert {k: per[k] for k in expected} == expected


def test_saved_activations_by_hand_and_linear_in_batch():
    """float32 tiny MLP: the backward reads both Gemm outputs, both Relu outputs (64 wide), the
    logits and the loss's log-probabilities (2 wide): 4 bytes * batch * (4 * 64 + 2 * 2)."""
    graph = step("adamw")
    for batch in (64, 128):
        report = estimate_memory(graph, batch=batch)
        assert report.saved_for_backward_bytes == 4 * batch * (4 * 64 + 2 * 2)
        assert report.saved_for_backward_values == 6
        assert report.transient_peak_bytes >= report.saved_for_backward_bytes
    low = estimate_memory(step("adamw", "bf16"), batch=64)
    assert low.saved_for_backward_bytes < estimate_memory(graph, batch=64).saved_for_backward_bytes


def test_an_emulated_step_graph_keeps_what_float32_keeps():
    """CPU emulation (``convert(..., emulate=True)``) computes in float32 and rounds every low
    value through a ``Cast(to=bf16) -> Cast(to=float)`` pair (``round/...``). Each weight's bf16
    copy is its low weight (2 bytes); the float32 round trip of that copy, which the backward
    reads, is a weight copy, not an activation. The backward keeps the rounded float32 twins of
    float32's six activations, so the same bytes; the optimizer reads float32 gradients."""
    fp32 = estimate_memory(step("adamw"), batch=64)
    emulated = mpgraph.convert(mpgraph.build_training_graph(TINY, optimizer="adamw"), "bf16", emulate=True)
    assert any(n.name.startswith("round/cast/fc2.weight") for n in emulated.graph)
    report = estimate_memory(emulated, batch=64)
    assert report.bytes_per_parameter == {"low_weights": 2.0, "master_weights": 4.0, "gradients": 4.0,
                                          "optimizer_state": 8.0}
    assert report.saved_for_backward_values == fp32.saved_for_backward_values == 6
    assert report.saved_for_backward_bytes == fp32.saved_for_backward_bytes == 4 * 64 * (4 * 64 + 2 * 2)
    assert report.transient_peak_bytes > fp32.transient_peak_bytes  # the bf16 copies live beside their inputs


def test_view_ops_share_their_input_buffer():
    """x -> Relu a -> Reshape a2 -> Identity a3 -> Relu b, then Add(a, b) -> y: a is still read
    after its views, so it is alive when b is made. The views alias a, so two buffers (a and b,
    4*N*8 bytes each) are the peak; a view with a buffer of its own would make it three (a, the
    view's copy that r2 reads, and b). y is an output buffer."""
    nodes = [
        h.make_node("Relu", ["x"], ["a"], name="r1"),
        h.make_node("Reshape", ["a", "shape"], ["a2"], name="v1"),
        h.make_node("Identity", ["a2"], ["a3"], name="v2"),
        h.make_node("Relu", ["a3"], ["b"], name="r2"),
        h.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    model = ir.from_proto(make_model(nodes, [vi("x", ["N", 8])], [vi("y", ["N", 8])], [init("shape", [-1, 8])]))
    model.metadata_props.update({md.MODEL_GRADIENTS: "[]", md.MODEL_STATE_PAIRS: "[]"})
    assert [n.name for n in ort_order(model)] == ["r1", "v1", "v2", "r2", "add"]
    report = estimate_memory(model, batch=16)
    assert report.transient_peak_bytes == 2 * 4 * 16 * 8
    assert report.transient_peak_node == "Relu 'r2'"
    assert report.output_bytes == report.data_bytes == 4 * 16 * 8
    assert report.unknown_shapes == 0


def test_refuses_a_forward_model():
    with pytest.raises(mpgraph.MpgraphError, match="not a training step graph"):
        estimate_memory(mpgraph.load_model(TINY), batch=1)


def test_cli_builds_the_step_graph_and_prints_json(tmp_path):
    result = CliRunner().invoke(app, ["audit", TINY, "--memory", "--batch", "32", "--policy", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["bytes_per_parameter"]["optimizer_state"] == 8.0 and data["batch"] == 32
    table = CliRunner().invoke(app, ["audit", TINY, "--memory", "--optimizer", "sgd"])
    assert table.exit_code == 0 and "bytes per parameter" in table.output
    converted = tmp_path / "tiny.bf16.onnx"
    mpgraph.save_model(mpgraph.convert(mpgraph.load_model(TINY), "bf16"), converted)
    refused = CliRunner().invoke(app, ["audit", str(converted), "--memory"])
    assert refused.exit_code == 2 and "converted forward model" in refused.output


def test_a_pipelined_trainer_holds_a_third_state_set():
    """``state_sets=3`` adds one more copy of every state input (parameters, moments, step
    counter) to the peak, nothing else; fewer than two sets is refused."""
    graph = step("adamw", "bf16")
    two, three = estimate_memory(graph, batch=64), estimate_memory(graph, batch=64, state_sets=3)
    state = three.role_bytes["master_weights"] + three.role_bytes["optimizer_state"] + three.other_state_bytes
    assert two.extra_state_set_bytes == 0 and three.extra_state_set_bytes == state > 0
    assert three.estimated_peak_bytes - two.estimated_peak_bytes == state
    with pytest.raises(mpgraph.MpgraphError, match="state_sets"):
        estimate_memory(graph, batch=64, state_sets=1)
    piped = CliRunner().invoke(app, ["audit", TINY, "--memory", "--pipelined", "--json"])
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.output)["extra_state_set_bytes"] > 0
    table = CliRunner().invoke(app, ["audit", TINY, "--memory", "--pipelined"])
    assert table.exit_code == 0 and "third state set" in table.output


def test_a_huge_batch_is_arithmetic_on_shapes(monkeypatch: pytest.MonkeyPatch):
    """--batch 1e9 once took 8 GB and a minute (1e12 never ended): onnx's data propagation
    allocates per batch element. Above PROBE_LIMIT the shapes come from small probes."""
    import onnx

    from mpgraph.audit import memory

    real = onnx.shape_inference.infer_shapes
    seen: list[int] = []

    def infer(model: onnx.ModelProto, *args: object, **kwargs: object) -> onnx.ModelProto:
        seen.extend(d.dim_value for v in model.graph.input for d in v.type.tensor_type.shape.dim)
        assert max(seen) < 10**6, "shape inference got the huge batch itself"  # (static dims reach 9,220)
        return real(model, *args, **kwargs)

    graph = step("adamw")
    small = estimate_memory(graph, batch=3000)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", infer)
    huge = estimate_memory(graph, batch=10**12)
    assert huge.data_bytes - 4 == (small.data_bytes - 4) // 3000 * 10**12  # x and label: 24 bytes a sample, lr 4
    assert huge.saved_for_backward_values == small.saved_for_backward_values and huge.unknown_shapes == small.unknown_shapes
    # The probes agree with plain inference wherever both can run.
    monkeypatch.setattr(memory, "PROBE_LIMIT", 0)
    assert estimate_memory(graph, batch=3000) == small
