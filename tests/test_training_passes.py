"""The passes of ``mpgraph.training``, one at a time, on small hand-made models.

Each test names the rule of the pass's docstring it checks, and checks ``modified``: True when
the pass changed the model, False on a second run or when there is nothing to do.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph._ir.meta import MODEL_FORWARD_OUTPUTS, MODEL_LOGITS, NODE_ROLE
from mpgraph.errors import GradientError, UnsupportedModelError
from mpgraph.training import (
    AttachLossPass,
    FoldConstantSubgraphsPass,
    NormalizeForwardPass,
    SelectParametersPass,
    SetBatchNormModePass,
    build_training_graph,
    load_forward,
    training_batchnorms,
)
from mpgraph.training.attach_loss import find_logits
from mpgraph.training.options import optimizer_options
from tests.helpers import init, make_model, vi


def _weights(shape: tuple[int, ...]) -> np.ndarray:
    """Seeded per call, so a model's weights do not depend on which tests ran before."""
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _ir(*args, **kwargs) -> ir.Model:
    return ir.from_proto(make_model(*args, **kwargs))


def _linear(out: str = "logits", params_as_inputs: bool = False) -> ir.Model:
    """x[N, 3] @ w[3, 4] + b -> ``out``; with ``params_as_inputs`` w and b are graph inputs too."""
    inputs = [vi("x", ["N", 3])] + ([vi("w", [3, 4]), vi("b", [4])] if params_as_inputs else [])
    return _ir(
        [h.make_node("MatMul", ["x", "w"], ["xw"], name="mm"), h.make_node("Add", ["xw", "b"], [out], name="add")],
        inputs, [vi(out, ["N", 4])],
        [init("w", _weights((3, 4))), init("b", np.zeros(4, np.float32))],
    )


def _with_loss() -> ir.Model:
    """The linear model with a SoftmaxCrossEntropyLoss output ``loss``, as exporters write it
    (loaded as ``build_training_graph`` loads it: with inferred types)."""
    return load_forward(make_model(
        [h.make_node("MatMul", ["x", "w"], ["logits"], name="mm"),
         h.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["ce"], name="ce", reduction="mean"),
         h.make_node("Identity", ["ce"], ["loss"], name="out")],
        [vi("x", ["N", 3]), vi("label", ["N"], T.INT64)], [vi("loss", [])],
        [init("w", _weights((3, 4)))],
    )).model


def _roles(model: ir.Model) -> dict[str, str | None]:
    return {n.name: n.metadata_props.get(NODE_ROLE) for n in model.graph}


# -- NormalizeForwardPass ----------------------------------------------------------------


def test_normalize_names_unnamed_nodes_and_outputs_then_changes_nothing() -> None:
    """Rule 3, and a second run is not a modification."""
    model = _ir([h.make_node("Relu", ["x"], ["y"]), h.make_node("Neg", ["y"], [""])], [vi("x", [2])], [vi("y", [2])])
    model.graph.node(1).outputs[0].name = None
    assert NormalizeForwardPass(inputs_mark_params=True)(model).modified
    assert [n.name for n in model.graph] == ["Relu_0", "Neg_1"]
    assert model.graph.node(1).outputs[0].name == "Neg_1/output_0"
    assert not NormalizeForwardPass(inputs_mark_params=True)(model).modified


def test_normalize_name_clash_gets_a_suffix() -> None:
    model = _ir([h.make_node("Relu", ["x"], ["y"], name="Neg_1"), h.make_node("Neg", ["y"], ["z"])],
                [vi("x", [2])], [vi("z", [2])])
    NormalizeForwardPass(inputs_mark_params=True)(model)
    assert [n.name for n in model.graph] == ["Neg_1", "Neg_1_1"]


def test_normalize_records_the_opset() -> None:
    """Rule 1: a graph without a default-domain opset entry gets MIN_OPSET."""
    model = _linear()
    del model.graph.opset_imports[""]
    assert NormalizeForwardPass(inputs_mark_params=True)(model).modified
    assert model.graph.opset_imports[""] == 18


def test_normalize_materializes_constant_of_shape_weights() -> None:
    """Rule 4: a float ConstantOfShape of a constant shape becomes an initializer (a weight)."""
    fill = h.make_tensor("value", T.FLOAT, [1], [0.25])
    model = _ir([h.make_node("ConstantOfShape", ["dims"], ["w"], name="fill", value=fill),
                 h.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                [vi("x", ["N", 3])], [vi("y", ["N", 2])], [init("dims", np.array([3, 2], np.int64))])
    assert NormalizeForwardPass(inputs_mark_params=True)(model).modified
    assert [n.op_type for n in model.graph] == ["MatMul"]
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), np.full((3, 2), 0.25, np.float32))


def test_normalize_unties_identity_initializers() -> None:
    """Rule 5: an Identity-named copy of a float initializer becomes an initializer of its own."""
    model = _ir([h.make_node("Identity", ["w"], ["w2"], name="w2"),
                 h.make_node("Mul", ["x", "w"], ["a"], name="a"), h.make_node("Mul", ["a", "w2"], ["y"], name="y")],
                [vi("x", [2])], [vi("y", [2])], [init("w", np.ones(2, np.float32))])
    assert NormalizeForwardPass(inputs_mark_params=True)(model).modified
    assert sorted(model.graph.initializers) == ["w", "w2"]
    assert [n.op_type for n in model.graph] == ["Mul", "Mul"]
    assert not NormalizeForwardPass(inputs_mark_params=True)(model).modified


def test_normalize_warns_about_folded_batchnorm(caplog: pytest.LogCaptureFixture) -> None:
    """Rule 2: a warning, and nothing changes because of it."""
    model = _linear()
    model.graph.node(0).metadata_props["pkg.onnxscript.rewriter.rule_name"] = "FuseBatchNormIntoConv"
    with caplog.at_level(logging.WARNING, logger="mpgraph.training"):
        assert not NormalizeForwardPass(inputs_mark_params=True)(model).modified
    assert "folded into the preceding convolution" in caplog.text and "'mm'" in caplog.text


def test_load_forward_refuses_control_flow() -> None:
    body = h.make_graph([h.make_node("Identity", ["x"], ["y"])], "b", [], [vi("y", [2])])
    proto = make_model([h.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)],
                       [vi("c", [], T.BOOL), vi("x", [2])], [vi("y", [2])])
    with pytest.raises(UnsupportedModelError, match="control flow"):
        load_forward(proto)


def test_load_forward_upgrades_and_remembers_the_opset() -> None:
    forward = load_forward(make_model([h.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])], opset=13))
    assert forward.opset == 13 and forward.model.graph.opset_imports[""] == 18 and forward.inputs_mark_params


def _scaled_linear(opset: int, weight_as_input: bool) -> onnx.ModelProto:
    """y = (x @ w) * half + b with ``half`` a 0-d float initializer (a constant, as older
    exporters write 0.5 or a LayerNorm epsilon), ``b`` a [3] initializer; with
    ``weight_as_input`` ``w`` is also a graph input (an explicit parameter)."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["t"]), h.make_node("Mul", ["t", "half"], ["u"]),
             h.make_node("Add", ["u", "b"], ["y"])]
    inputs = [vi("x", [2, 4])] + ([vi("w", [4, 3])] if weight_as_input else [])
    inits = [init("w", np.ones((4, 3), np.float32)), init("half", np.float32(0.5)), init("b", np.zeros(3, np.float32))]
    return make_model(nodes, inputs, [vi("y", [2, 3])], inits, opset=opset, ir_version=8)


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_an_upgraded_model_trains_the_same_parameters(opset: int) -> None:
    """Upgrading an opset below 18 lists every initializer as a graph input for the converter;
    those inputs go again afterwards. Left in, every float initializer looked like an explicit
    parameter, so a model below opset 18 trained its scalar constants (here ``half``)."""
    implicit = build_training_graph(_scaled_linear(opset, False), optimizer="sgd", loss="y")
    assert [v.name for v in implicit.graph.inputs] == ["x", "w", "b", "lr"]
    explicit = build_training_graph(_scaled_linear(opset, True), optimizer="sgd", loss="y")
    assert [v.name for v in explicit.graph.inputs] == ["x", "w", "lr"]


# -- FoldConstantSubgraphsPass -----------------------------------------------------------


def test_fold_replaces_constant_chains_with_a_constant() -> None:
    """Rules 1, 3 and 5: Shape arithmetic of constants folds; the parameter path stays."""
    proto = make_model([h.make_node("Concat", ["a", "b"], ["shape"], name="cat", axis=0),
                        h.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
                       [vi("x", [6])], [vi("y", [2, 3])],
                       [init("a", np.array([2], np.int64)), init("b", np.array([3], np.int64))])
    model = load_forward(proto).model  # shape inference types the Concat output
    assert FoldConstantSubgraphsPass(inputs_mark_params=True)(model).modified
    assert [n.name for n in model.graph] == ["cat/folded", "reshape"]
    assert not FoldConstantSubgraphsPass(inputs_mark_params=True)(model).modified


def test_fold_leaves_parameters_alone() -> None:
    """Rule 1: a node reading a parameter (a float initializer of rank >= 1) is not folded."""
    model = _ir([h.make_node("Neg", ["w"], ["nw"], name="neg"), h.make_node("Mul", ["x", "nw"], ["y"], name="mul")],
                [vi("x", [2])], [vi("y", [2])], [init("w", np.ones(2, np.float32))])
    assert not FoldConstantSubgraphsPass(inputs_mark_params=True)(model).modified
    assert [n.name for n in model.graph] == ["neg", "mul"]



def test_fold_evaluates_without_onnxruntime() -> None:
    """Rule 2: the values are computed by onnx's reference evaluator (a float Sqrt here), and
    nothing in the pass imports onnxruntime (tests/test_architecture.py: training runs no model)."""
    model = _ir([h.make_node("Sqrt", ["a"], ["r"], name="sqrt"), h.make_node("Mul", ["x", "r"], ["y"], name="mul")],
                [vi("x", [2])], [vi("y", [2])], [init("a", np.array(4.0, np.float32))])
    model.graph.node(0).outputs[0].dtype = ir.DataType.FLOAT
    assert FoldConstantSubgraphsPass(inputs_mark_params=True)(model).modified
    assert ir.convenience.get_const_tensor(model.graph.node(1).inputs[1]).numpy().tolist() == 2.0


def test_fold_warns_and_changes_nothing_when_it_cannot_evaluate(caplog: pytest.LogCaptureFixture) -> None:
    """Rule 2: a constant subgraph the evaluator refuses (6 elements reshaped to 4) stays."""
    model = _ir([h.make_node("Reshape", ["a", "s"], ["r"], name="bad"), h.make_node("Add", ["x", "r"], ["y"], name="add")],
                [vi("x", [4])], [vi("y", [4])],
                [init("a", np.arange(6, dtype=np.int64)), init("s", np.array([4], np.int64))])
    model.graph.node(0).outputs[0].dtype = ir.DataType.INT64
    with caplog.at_level(logging.WARNING, logger="mpgraph.training.fold_constant_subgraphs"):
        assert not FoldConstantSubgraphsPass(inputs_mark_params=True)(model).modified
    assert [n.name for n in model.graph] == ["bad", "add"] and "constant folding skipped" in caplog.text

# -- AttachLossPass ----------------------------------------------------------------------


def test_loss_output_is_picked_and_its_chain_is_role_loss() -> None:
    """Rules 1 and 6: the output named ``loss``; the loss op and what follows it are ``loss``."""
    model = _with_loss()
    result = AttachLossPass()(model)
    assert result.modified and result.loss is not None and result.loss.name == "loss"
    assert _roles(model) == {"mm": "forward", "ce": "loss", "out": "loss"}
    assert not AttachLossPass()(model).modified  # the roles are already there


@pytest.mark.parametrize(("loss", "ops", "label_type"), [
    ("mse", ["Sub", "Mul", "ReduceMean"], ir.DataType.FLOAT),
    ("cross_entropy", ["SoftmaxCrossEntropyLoss"], ir.DataType.INT64),
])
def test_builtin_loss_is_attached_to_the_first_float_output(loss: str, ops: list[str], label_type: ir.DataType) -> None:
    """Rules 3 and 4: new nodes with role ``loss``, a new ``label`` input, the value named ``loss``."""
    model = _linear()
    result = AttachLossPass(loss)(model)
    assert result.modified and result.loss is not None and result.loss.name == "loss"
    assert [n.op_type for n in model.graph][2:] == ops
    assert [n.metadata_props[NODE_ROLE] for n in model.graph] == ["forward"] * 2 + ["loss"] * len(ops)
    label = model.graph.inputs[-1]
    assert label.name == "label" and label.dtype == label_type


def test_loss_errors_list_the_outputs() -> None:
    """Rules 1 and 5."""
    with pytest.raises(GradientError, match=r"no loss: .*logits float\[N, 4\]"):
        AttachLossPass()(_linear())
    with pytest.raises(GradientError, match=r"unknown loss 'hinge'.*logits float\[N, 4\]"):
        AttachLossPass("hinge")(_linear())


def test_only_float_scalar_output_is_the_loss() -> None:
    """Rule 1: a model whose only output is a float scalar is taken at its word."""
    model = _ir([h.make_node("ReduceSum", ["x"], ["total"], name="sum", keepdims=0)], [vi("x", [2])], [vi("total", [])])
    result = AttachLossPass()(model)
    assert result.loss is not None and result.loss.name == "total"


# -- SetBatchNormModePass ----------------------------------------------------------------


def _batchnorm(shared_var: bool = False) -> ir.Model:
    stats = [init(n, np.ones(2, np.float32) if n in ("s", "v") else np.zeros(2, np.float32)) for n in "sbmv"]
    var = "s" if shared_var else "v"  # a running variance that is also the scale (as TorchScript dedups)
    return _ir([h.make_node("BatchNormalization", ["x", "s", "b", "m", var], ["y"], name="bn")],
               [vi("x", ["N", 2, 3])], [vi("y", ["N", 2, 3])], stats if not shared_var else stats[:3])


def test_batchnorm_train_pairs_running_statistics_as_state() -> None:
    """Rule 2: training mode, three outputs, running statistics as graph inputs paired with updates."""
    model = _batchnorm()
    result = SetBatchNormModePass("train")(model)
    assert result.modified
    assert [(a.name, b.name) for a, b in result.state] == [("m", "bn/output_1"), ("v", "bn/output_2")]
    assert [v.name for v in model.graph.inputs] == ["x", "m", "v"]
    assert training_batchnorms(model) == 1
    assert not SetBatchNormModePass("train")(model).modified


def test_batchnorm_shared_statistic_gets_its_own_copy() -> None:
    """Rule 3: the running variance shared with the scale is copied to ``bn/running_var``."""
    model = _batchnorm(shared_var=True)
    state = SetBatchNormModePass("train")(model).state
    assert [a.name for a, _ in state] == ["m", "bn/running_var"]
    assert model.graph.node(0).inputs[1].name == "s"


def test_batchnorm_train_ops_writes_the_definition() -> None:
    """Rule 4: the node becomes ReduceMean/Sub/... in its place, its outputs keep their names."""
    model = _batchnorm()
    state = SetBatchNormModePass("train-ops")(model).state
    ops = [n.op_type for n in model.graph]
    assert "BatchNormalization" not in ops and ops[0] == "ReduceMean"
    assert all(n.name.startswith("bn/bn/") and n.metadata_props[NODE_ROLE] == "forward" for n in model.graph)
    assert model.graph.outputs[0].name == "y" and [a.name for a, _ in state] == ["m", "v"]
    assert training_batchnorms(model) == 0


def test_batchnorm_eval_has_no_state() -> None:
    """Rule 1: ``training_mode=0`` is written (a change), then nothing changes."""
    model = _batchnorm()
    result = SetBatchNormModePass("eval")(model)
    assert result.modified and result.state == []
    assert model.graph.node(0).attributes.get_int("training_mode") == 0
    assert not SetBatchNormModePass("eval")(model).modified


def test_batchnorm_mode_is_checked_and_no_batchnorm_is_no_change() -> None:
    with pytest.raises(GradientError, match="batchnorm must be"):
        SetBatchNormModePass("frozen")
    assert not SetBatchNormModePass("train")(_linear()).modified


# -- SelectParametersPass ----------------------------------------------------------------


def test_parameters_are_float_initializers_made_inputs() -> None:
    """Rules 1 and 4: without explicit inputs every float initializer of rank >= 1 is one."""
    model = _linear()
    result = SelectParametersPass(inputs_mark_params=True)(model)
    assert result.modified and [p.name for p in result.params] == ["w", "b"]
    assert [v.name for v in model.graph.inputs] == ["x", "w", "b"]
    assert not SelectParametersPass(inputs_mark_params=True)(model).modified


def test_explicit_parameters_and_freeze() -> None:
    """Rules 1 and 3: explicit inputs mark the parameters; a frozen one leaves the inputs."""
    model = _linear(params_as_inputs=True)
    result = SelectParametersPass(freeze=["b"], inputs_mark_params=True)(model)
    assert result.modified and [p.name for p in result.params] == ["w"]
    assert [v.name for v in model.graph.inputs] == ["x", "w"]


def test_parameter_errors() -> None:
    """Rules 2, 3 and 4: patterns that match nothing, and nothing left to train."""
    with pytest.raises(GradientError, match=r"freeze pattern 'q\*' matches no parameter \(parameters: w, b\)"):
        SelectParametersPass(freeze=["q*"], inputs_mark_params=True)(_linear())
    with pytest.raises(GradientError, match="trainable input pattern 'z' matches no float graph input"):
        SelectParametersPass(trainable_inputs=["z"], inputs_mark_params=True)(_linear())
    with pytest.raises(GradientError, match="nothing to train"):
        SelectParametersPass(freeze=["*"], inputs_mark_params=True)(_linear())


def test_trainable_inputs_and_excluded_state() -> None:
    """Rules 2 and 5: a runtime input can be trained; excluded names never are parameters."""
    model = _linear()
    result = SelectParametersPass(trainable_inputs=["x"], exclude={"b"}, inputs_mark_params=True)(model)
    assert [p.name for p in result.params] == ["w", "x"]


# -- build_training_graph's records ------------------------------------------------------


def test_step_graph_records_logits_and_forward_outputs() -> None:
    """A loss output: the logits are the loss op's scores (here named ``logits``)."""
    step = build_training_graph(_with_loss(), optimizer="sgd")
    assert step.metadata_props[MODEL_LOGITS] == "logits" == find_logits(step.graph)
    assert json.loads(step.metadata_props[MODEL_FORWARD_OUTPUTS]) == ["loss"]


def test_attached_cross_entropy_records_its_scores_as_logits() -> None:
    """No value named ``logits``: the first input of the loss op, as the runtime used to guess."""
    step = build_training_graph(_linear(out="scores"), optimizer="adam", loss="cross_entropy")
    assert step.metadata_props[MODEL_LOGITS] == "scores"
    assert json.loads(step.metadata_props[MODEL_FORWARD_OUTPUTS]) == ["scores"]


def test_mse_without_logits_records_none() -> None:
    step = build_training_graph(_linear(out="y"), optimizer=None, loss="mse")
    assert MODEL_LOGITS not in step.metadata_props
    assert json.loads(step.metadata_props[MODEL_FORWARD_OUTPUTS]) == ["y"]


def test_zoo_step_graph_records_logits() -> None:
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw")
    assert step.metadata_props[MODEL_LOGITS] == "logits"
    assert json.loads(step.metadata_props[MODEL_FORWARD_OUTPUTS]) == ["loss", "logits"]


def test_optimizer_options_from_flags() -> None:
    assert optimizer_options("sgd", momentum=0.9, nesterov=True, flat=True) == {
        "momentum": 0.9, "weight_decay": None, "nesterov": True, "flat": True}
    with pytest.raises(Exception, match="--nesterov applies to --optimizer sgd only"):
        optimizer_options("adam", nesterov=True)
    with pytest.raises(Exception, match="--amsgrad applies to --optimizer adam and adamw only"):
        optimizer_options("sgd", amsgrad=True)


def test_a_torchscript_export_below_opset_18_keeps_its_scalar_buffer_fixed() -> None:
    """A real export: torch's torchscript exporter at opset 17 writes a registered 0-d buffer
    as a 0-d initializer. The step trains the Linear's weight and bias, not the buffer."""
    import io

    import torch

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.register_buffer("scale", torch.tensor(0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.scale

    torch.manual_seed(0)
    f = io.BytesIO()
    torch.onnx.export(Scaled(), (torch.randn(2, 4),), f, dynamo=False, opset_version=17)
    proto = onnx.load_from_string(f.getvalue())
    assert ("scale", []) in [(i.name, list(i.dims)) for i in proto.graph.initializer]
    step = build_training_graph(proto, optimizer="sgd", loss="mse")
    trained = {v.name for v in step.graph.inputs} - {"label", "lr", proto.graph.input[0].name}
    assert trained == {"fc.weight", "fc.bias"}
