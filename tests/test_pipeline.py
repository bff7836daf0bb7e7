"""build_pipeline is an onnx_ir PassManager whose failures name the pass; UpgradeOpsetPass's rules."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph._ir import meta as md
from mpgraph.convert import build_pipeline, convert
from mpgraph.errors import MpgraphError
from mpgraph.passes import Pipeline, upgrade_opset
from mpgraph.passes.upgrade_opset import MAX_UPGRADE_OPSET, UpgradeOpsetPass, needed_opset
from mpgraph.policy import load_policy
from mpgraph.runtime.probe import Calibration, ValueRange


def _mlp(opset: int = 18, ir_version: int = 8) -> ir.Model:
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1"), h.make_node("Relu", ["y"], ["z"], name="relu")]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("z", T.FLOAT, [2, 4])],
        [h.make_tensor("w", T.FLOAT, [3, 4], np.ones(12, np.float32))],
    )
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=ir_version))


def test_passes_import_nothing_that_runs_a_model() -> None:
    """The compiler's passes only read what a probe measured: no onnxruntime, no mpgraph.runtime."""
    bad = []
    for path in sorted((Path(__file__).resolve().parents[1] / "mpgraph" / "passes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "onnxruntime"
                    or n == "mpgraph.runtime" or n.startswith("mpgraph.runtime.")]
    assert not bad, bad


# --- the pipeline ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "kwargs", "names"),
    [
        ("fp32", {}, ["InferTypesPass", "AssignPrecisionPass", "ValidateModelPass"]),
        ("bf16", {"validate": False}, ["InferTypesPass", "ScaleLossPass", "AssignPrecisionPass", "InsertCastsPass",
                                       "FoldCastsPass"]),
        ("fp16", {"emulate": True, "infer_types": False, "calibration": Calibration({}, {}, {}, ir.DataType.FLOAT16)},
         ["CalibrateRangePass", "ScaleLossPass", "AssignPrecisionPass", "InsertCastsPass", "FoldCastsPass",
          "EmulatePrecisionPass", "FoldCastsPass", "ValidateModelPass"]),
    ],
)
def test_build_pipeline_is_a_pass_manager_of_named_passes(policy: str, kwargs: dict, names: list[str]) -> None:
    pipeline = build_pipeline(load_policy(policy), **kwargs)
    assert isinstance(pipeline, ir.passes.PassManager)
    assert pipeline.names == names


def test_the_pipeline_converts_as_convert_does() -> None:
    model, reference = _mlp(), convert(_mlp(), "bf16", calibrate=None, validate=False, upgrade_opset=False)
    result = build_pipeline(load_policy("bf16"), validate=False)(model)
    assert result.modified and result.model is model
    assert ir.to_proto(model).graph == ir.to_proto(reference).graph


class _Raises(ir.passes.InPlacePass):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        raise self.error


class _Marks(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.metadata_props["marked"] = "yes"
        return ir.passes.PassResult(model, True)


@pytest.mark.parametrize("error", [MpgraphError("node 'n': no rule"), ValueError("internal")])
def test_a_failing_pass_keeps_its_error_and_is_named(error: Exception) -> None:
    pipeline = Pipeline([_Marks(), _Raises(error), _Marks()])
    with pytest.raises(type(error)) as info:
        pipeline(_mlp())
    assert info.value is error and str(info.value) == str(error)  # the CLI prints it as it was
    assert info.value.__notes__ == ["raised in pass 2 of 3 of the pipeline: _Raises"]


def test_an_error_inside_a_real_pass_names_it() -> None:
    model = _mlp()
    model.graph.initializers["w"].const_value = ir.tensor(np.ones((4, 4), np.float32), name="w")  # [2,3] @ [4,4]
    model.graph.initializers["w"].shape = ir.Shape([4, 4])
    with pytest.raises(MpgraphError, match="rewritten model is invalid ONNX") as info:
        build_pipeline(load_policy("bf16"))(model)
    assert info.value.__notes__ == ["raised in pass 6 of 6 of the pipeline: ValidateModelPass"]


def test_modified_is_any_pass_modified() -> None:
    assert not Pipeline([UpgradeOpsetPass(load_policy("bf16"))])(_mlp()).modified
    assert Pipeline([UpgradeOpsetPass(load_policy("bf16")), _Marks()])(_mlp()).modified


# --- UpgradeOpsetPass -------------------------------------------------------------------------


def test_rule1_a_converted_model_or_one_without_default_opset_is_left() -> None:
    converted = _mlp(opset=12)
    converted.metadata_props[md.MODEL_POLICY] = "bf16"
    assert not UpgradeOpsetPass(load_policy("bf16"))(converted).modified
    assert converted.opset_imports[""] == 12
    foreign = _mlp(opset=12)
    foreign.graph.opset_imports.pop("")
    foreign.graph.opset_imports["custom"] = 1
    assert not UpgradeOpsetPass(load_policy("bf16"))(foreign).modified


def test_rule2_the_lowest_opset_that_admits_the_low_dtype() -> None:
    policy = load_policy("bf16")
    assert needed_opset(_mlp(opset=12), policy, 12) == 13  # MatMul admits bfloat16 from 13
    assert not UpgradeOpsetPass(policy)(_mlp(opset=13)).modified  # already there
    assert not UpgradeOpsetPass(load_policy("fp16"))(_mlp(opset=12)).modified  # float16 admitted at 12


def test_rule2_denied_ops_do_not_count() -> None:
    base = load_policy("bf16")
    deny = dataclasses.replace(base, ops={**base.ops, "MatMul": ("deny", "test"), "Relu": ("deny", "test")})
    assert needed_opset(_mlp(opset=12), deny, 12) == 12

def _conv(opset: int) -> ir.Model:
    node = h.make_node("Conv", ["x", "w"], ["y"], name="conv")  # Conv admits bfloat16 from opset 22
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 1, 3, 3])],
                         [h.make_tensor_value_info("y", T.FLOAT, None)],
                         [h.make_tensor("w", T.FLOAT, [1, 1, 2, 2], np.ones(4, np.float32))])
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=8))


def test_rule2_no_upgrade_beyond_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_UPGRADE_OPSET == 22 and needed_opset(_conv(18), load_policy("bf16"), 18) == 22
    monkeypatch.setattr(upgrade_opset, "MAX_UPGRADE_OPSET", 21)
    assert needed_opset(_conv(18), load_policy("bf16"), 18) == 18
    assert not UpgradeOpsetPass(load_policy("bf16"))(_conv(18)).modified


def test_rules3to5_upgrade_in_place_raise_ir_version_keep_metadata_record() -> None:
    model = _conv(18)
    model.graph.node("conv").metadata_props[md.NODE_ROLE] = "backward"
    model.metadata_props["kept"] = "yes"
    result = UpgradeOpsetPass(load_policy("bf16"))(model)
    assert result.modified and result.model is model
    assert model.opset_imports[""] == 22 and model.ir_version == 10  # opset 22 needs IR 10
    assert model.graph.node("conv").metadata_props[md.NODE_ROLE] == "backward"
    assert model.metadata_props == {"kept": "yes", md.MODEL_OPSET_UPGRADED: "18->22"}
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_rule6_a_converter_failure_warns_and_leaves_the_model(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    def fail(proto: onnx.ModelProto, target: int) -> onnx.ModelProto:
        raise RuntimeError("no adapter for MatMul\nsecond line")

    monkeypatch.setattr(upgrade_opset.version_converter, "convert_version", fail)
    model = _mlp(opset=12)
    before = ir.to_proto(model).SerializeToString()
    with caplog.at_level(logging.WARNING, logger="mpgraph.passes.upgrade_opset"):
        assert not UpgradeOpsetPass(load_policy("bf16"))(model).modified
    assert ir.to_proto(model).SerializeToString() == before
    assert "opset 12 -> 13 upgrade failed (no adapter for MatMul); ops without bfloat16 stay float32" in caplog.text


def test_convert_upgrades_through_the_pass() -> None:
    low = convert(_mlp(opset=12), "bf16", calibrate=None)
    assert low.metadata_props[md.MODEL_OPSET_UPGRADED] == "12->13"
    assert low.graph.node("allow1").metadata_props[md.NODE_PRECISION] == "bfloat16"
    kept = convert(_mlp(opset=12), "bf16", calibrate=None, upgrade_opset=False)
    assert kept.graph.node("allow1").metadata_props[md.NODE_PRECISION] == "float32"


def test_calibration_reaches_the_precision_decision() -> None:
    # MatMul's output measured beyond fp16's range / 2: the calibration keeps it float32.
    cal = Calibration({}, {"y": ValueRange(1e5, 0.0)}, {}, ir.DataType.FLOAT16)
    model = _mlp()
    build_pipeline(load_policy("fp16"), validate=False, calibration=cal)(model)
    assert model.graph.node("allow1").metadata_props[md.NODE_PRECISION] == "float32"
