"""Typed decisions: every node records the phase that decided it, and code reads the phase.

Node names state the expected category, as in grappler's tests (``allow1`` an allow op,
``deny1`` a deny op, ``infer1`` an infer op, ``clear1`` a clear op); each test checks the
``mpgraph.phase`` of those nodes, so the tests read like ``AssignPrecisionPass``'s phases.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import mpgraph
from mpgraph._ir import meta as md
from mpgraph._ir.meta import Phase, Precision, Role
from mpgraph.cli.targets_cmd import conversion_notes
from mpgraph.errors import ValidationError
from mpgraph.passes.assign_precision import AssignPrecisionPass, Decision, record_decision
from mpgraph.passes.infer_types import InferTypesPass
from mpgraph.passes.validate_model import check_precision_invariants
from mpgraph.policy.schema import Override, Policy
from tests.helpers import init, make_model, mlp_model, vi

#: A policy that states every category these tests use.
SPEC = Policy(
    "spec",
    ir.DataType.BFLOAT16,
    ops={
        "MatMul": ("allow", "fast"),
        "Add": ("infer", "follows"),
        "Mul": ("infer", "follows"),
        "Relu": ("clear", "moves"),
        "Reshape": ("clear", "moves"),
        "Softmax": ("deny", "range"),
    },
)


def decide(proto: onnx.ModelProto, policy: Policy = SPEC) -> ir.Model:
    model = ir.from_proto(proto)
    InferTypesPass()(model)
    AssignPrecisionPass(policy)(model)
    return model


def phase(model: ir.Model, name: str) -> str | None:
    return model.graph.node(name).metadata_props.get(md.NODE_PHASE)


def meta(model: ir.Model, name: str, key: str) -> str | None:
    return model.graph.node(name).metadata_props.get(key)


def attention() -> onnx.ModelProto:
    """x -> MatMul(allow1) -> Softmax(deny1) -> MatMul(allow2) -> Add(infer1) at the end."""
    rng = np.random.default_rng(1)
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"], name="allow1"),
        h.make_node("Softmax", ["a"], ["p"], name="deny1", axis=-1),
        h.make_node("MatMul", ["p", "w2"], ["d"], name="allow2"),
        h.make_node("Add", ["d", "b"], ["y"], name="infer1"),
    ]
    weights = [
        init("w1", rng.standard_normal((4, 4)).astype(np.float32)),
        init("w2", rng.standard_normal((4, 4)).astype(np.float32)),
        init("b", rng.standard_normal(4).astype(np.float32)),
    ]
    return make_model(nodes, [vi("x", ["N", 4])], [vi("y", ["N", 4])], weights)


def test_allow1_is_decided_by_the_allow_phase():
    m = decide(mlp_model())
    for name in ("allow1", "allow2"):
        assert phase(m, name) == Phase.ALLOW
        assert meta(m, name, md.NODE_PRECISION) == Precision.BFLOAT16
        assert meta(m, name, md.NODE_REASON) == "allow list: fast"


def test_infer1_and_clear1_between_allow_ops():
    m = decide(mlp_model())
    assert phase(m, "infer1") == Phase.BETWEEN
    assert phase(m, "clear1") == Phase.BETWEEN


def test_deny1_is_denied_and_spreads_to_infer2():
    m = decide(mlp_model())
    assert phase(m, "deny1") == Phase.DENY
    assert meta(m, "deny1", md.NODE_REASON) == "deny list: range"
    assert phase(m, "infer2") == Phase.DENY_SPREAD
    assert meta(m, "infer2", md.NODE_PRECISION) == Precision.FLOAT32


def test_deny1_between_low_ops_takes_low_io_and_infer1_follows():
    m = decide(attention())
    assert phase(m, "deny1") == Phase.LOW_IO
    assert meta(m, "deny1", md.NODE_PRECISION) == Precision.BFLOAT16
    assert phase(m, "infer1") == Phase.FOLLOW


def test_infer1_with_float32_inputs_and_unlisted1_by_default():
    nodes = [
        h.make_node("Add", ["x", "x"], ["a"], name="infer1"),
        h.make_node("Exp", ["a"], ["y"], name="unlisted1"),
    ]
    m = decide(make_model(nodes, [vi("x", [2])], [vi("y", [2])]))
    assert phase(m, "infer1") == Phase.FLOAT32_INPUTS
    assert meta(m, "infer1", md.NODE_REASON) == "infer op with float32 inputs"
    assert phase(m, "unlisted1") == Phase.DENY
    assert meta(m, "unlisted1", md.NODE_REASON) == "not listed (default deny)"


def test_clear1_feeding_only_low_ops():
    nodes = [
        h.make_node("Reshape", ["x", "shape"], ["r"], name="clear1"),
        h.make_node("MatMul", ["r", "w"], ["y"], name="allow1"),
    ]
    weights = [init("shape", np.array([2, 4], np.int64)), init("w", np.ones((4, 3), np.float32))]
    m = decide(make_model(nodes, [vi("x", [8])], [vi("y", [2, 3])], weights))
    assert phase(m, "clear1") == Phase.CLEAR_FEEDS_LOW


def test_none1_fixed_and_override1():
    nodes = [
        h.make_node("Shape", ["x"], ["s"], name="none1"),
        h.make_node("MatMul", ["x", "w"], ["y"], name="override1"),
    ]
    weights = [init("w", np.ones((4, 4), np.float32))]
    policy = Policy("spec", ir.DataType.BFLOAT16, ops=SPEC.ops, overrides=(Override("override*", "float32", "exact"),))
    m = decide(make_model(nodes, [vi("x", [4, 4])], [vi("y", [4, 4]), vi("s", [2], T.INT64)], weights), policy)
    assert phase(m, "none1") == Phase.FIXED
    assert meta(m, "none1", md.NODE_PRECISION) == Precision.NONE
    assert phase(m, "override1") == Phase.OVERRIDE
    assert meta(m, "override1", md.NODE_REASON) == "override 'override*': exact"


def _forward_with_backward1() -> ir.Model:
    """MatMul ``allow1`` -> Softmax ``deny1`` -> Mul ``backward1``, every node marked forward
    (the test then marks ``backward1`` and its link)."""
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"], name="allow1"),
        h.make_node("Softmax", ["a"], ["y"], name="deny1", axis=-1),
        h.make_node("Mul", ["y", "y"], ["g"], name="backward1"),
    ]
    model = ir.from_proto(make_model(nodes, [vi("x", [2, 4])], [vi("g", [2, 4])], [init("w", np.ones((4, 4), np.float32))]))
    for node in model.graph:
        node.metadata_props[md.NODE_ROLE] = Role.FORWARD
    return model


def test_allow1_backward_follows_its_forward_twin():
    model = _forward_with_backward1()
    backward = model.graph.node("backward1")
    backward.metadata_props[md.NODE_ROLE] = Role.BACKWARD
    backward.metadata_props[md.NODE_GRAD_OF] = "allow1"
    InferTypesPass()(model)
    AssignPrecisionPass(SPEC)(model)
    assert phase(model, "backward1") == Phase.BACKWARD


def test_allow1_backward_finds_its_twin_by_value_after_renames():
    """The link a gradient rule records is the forward node's output value: renaming the
    forward node (and leaving its stale name on the backward node) changes nothing."""
    model = _forward_with_backward1()
    backward = model.graph.node("backward1")
    backward.metadata_props.update({md.NODE_ROLE: Role.BACKWARD, md.NODE_GRAD_OF: "allow1", md.NODE_GRAD_OF_VALUE: "a"})
    model.graph.node("allow1").name = "renamed"
    model.graph.node("deny1").name = "allow1"  # the stale name now names a deny op
    InferTypesPass()(model)
    AssignPrecisionPass(SPEC)(model)
    assert phase(model, "backward1") == Phase.BACKWARD


def test_deny1_kernel_gap_of_the_target():
    policy = Policy("spec", ir.DataType.BFLOAT16, ops=SPEC.ops, kernel_gaps={"Relu": "no bfloat16 kernel on cpu (test)"})
    m = decide(mlp_model(), policy)
    assert phase(m, "clear1") == Phase.KERNEL_GAP
    assert meta(m, "clear1", md.NODE_REASON) == "no bfloat16 kernel on cpu (test)"  # no "deny list: "


def test_identity_policy_and_recorded_phases_are_kept():
    m = decide(mlp_model(), Policy("fp32", ir.DataType.FLOAT))
    assert {phase(m, n.name) for n in m.graph} == {Phase.IDENTITY}
    m = decide(mlp_model())
    before = {n.name: dict(n.metadata_props) for n in m.graph}
    assert not AssignPrecisionPass(SPEC)(m).modified
    assert {n.name: dict(n.metadata_props) for n in m.graph} == before


@pytest.mark.parametrize("preset", ["bf16", "fp16", "fp32"])
def test_every_decided_node_of_a_conversion_has_a_phase(preset):
    m = mpgraph.convert(mlp_model(), preset)
    for node in m.graph:
        if md.NODE_INSERTED not in node.metadata_props:
            assert node.metadata_props.get(md.NODE_PHASE) in set(Phase), node.name


def test_decisions_are_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="mpgraph.passes.assign_precision"):
        decide(mlp_model())
    logged = [r.getMessage() for r in caplog.records if r.name == "mpgraph.passes.assign_precision"]
    assert len(logged) == 6
    assert "allow: MatMul 'allow1' -> bfloat16 (allow list: fast)" in logged
    assert any(m.startswith("deny_spread: Mul 'infer2' -> float32") for m in logged)


def input_dtype_model() -> ir.Model:
    """A float16 MatMul in the input model, decided float32 by a bfloat16 policy (input_dtype1)."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="input_dtype1")]
    w = init("w", np.ones((2, 2), np.float16))
    return decide(make_model(nodes, [vi("x", [2, 2], T.FLOAT16)], [vi("y", [2, 2], T.FLOAT16)], [w]))


def test_validation_keys_off_the_phase_not_the_reason():
    m = input_dtype_model()
    assert phase(m, "input_dtype1") == Phase.INPUT_DTYPE
    assert meta(m, "input_dtype1", md.NODE_PRECISION) == Precision.FLOAT32
    node = m.graph.node("input_dtype1")
    node.metadata_props[md.NODE_REASON] = "reworded"
    check_precision_invariants(m)  # the phase says the input model computes it in float16
    record_decision(node, Decision(Precision.FLOAT32, Phase.DENY, "computes in float16; only float32 ops are lowered"))
    with pytest.raises(ValidationError, match="decided float32 but input 0 'x' is float16"):
        check_precision_invariants(m)


def test_target_notes_count_kernel_gaps_by_phase():
    policy = Policy("spec", ir.DataType.BFLOAT16, ops=SPEC.ops, kernel_gaps={"Relu": "reworded: no kernel"})
    m = decide(mlp_model(), policy)
    m.metadata_props[md.MODEL_DTYPE] = "bfloat16"
    m.metadata_props[md.MODEL_TARGET] = "cpu"
    assert any(line.startswith("target cpu: 1 ops kept float32") for line in conversion_notes(m, emulate=True))


def test_renaming_every_node_of_a_step_graph_changes_no_decision():
    """The zoo GPT's AdamW step under bf16 (phases 0, 5 and 8 follow backward-to-forward
    links): every node renamed, the 433 decisions stay as they were. A graph saved before the
    value link (``mpgraph.grad_of`` only) decides the same unrenamed. Measured: with the name
    link alone, renaming changed 97 of 433 decisions. About 2 CPU-s."""
    from pathlib import Path

    from mpgraph.training import build_training_graph

    step = ir.to_proto(build_training_graph(Path(__file__).resolve().parents[1] / "models/onnx/gpt.loss.onnx"))

    def decisions(proto: onnx.ModelProto, rename: bool = False, legacy: bool = False) -> list[tuple[str, str]]:
        model = ir.from_proto(proto)
        for i, node in enumerate(model.graph):
            node.name = f"n{i}" if rename else node.name
            if legacy:
                node.metadata_props.pop(md.NODE_GRAD_OF_VALUE, None)
        out = mpgraph.convert(model, "bf16")
        return [(n.metadata_props[md.NODE_PRECISION], n.metadata_props[md.NODE_PHASE])
                for n in out.graph if md.NODE_INSERTED not in n.metadata_props]

    plain = decisions(step)
    assert {Phase.BACKWARD, Phase.LOW_IO_BACKWARD} <= {p for _, p in plain}
    assert decisions(step, rename=True) == plain
    assert decisions(step, legacy=True) == plain
