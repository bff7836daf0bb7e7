"""``StepContract``: one typed record of a step graph's contract, over its metadata.

Training writes it once, the passes that add state record that state through it, readers get
every field from ``read``; graphs saved before a key existed read as they always did.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx_ir as ir
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph._ir.contract import LossScaleState, StepContract, check_recorded
from mpgraph.training import build_training_graph
from mpgraph.training.split_step_graph import split_step_graph

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"


@pytest.fixture(scope="module")
def gpt_step() -> ir.Model:
    return build_training_graph(ZOO / "gpt.loss.onnx", optimizer="adamw")


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def test_the_built_step_graph_reads_back_every_field(gpt_step: ir.Model) -> None:
    contract = StepContract.read(gpt_step)
    assert (contract.loss, contract.grad_seed, contract.logits, contract.lr) == ("loss", "grad/seed", "logits", "lr")
    assert contract.data_inputs == ("tokens", "label") and contract.forward_outputs == ("loss", "logits")
    outputs = {v.name for v in gpt_step.graph.outputs}
    inputs = {v.name for v in gpt_step.graph.inputs}
    assert set(contract.state_outputs) <= outputs and set(contract.state_inputs) <= inputs
    assert contract.gradients is not None and {p for p, _ in contract.gradients} <= set(contract.state_inputs)
    # The zoo GPT: vocabulary 64, labels of SoftmaxCrossEntropyLoss with ignore_index -100.
    assert dict(contract.vocab) == {"tokens": 64} and dict(contract.label_bounds) == {"label": (64, -100)}
    assert contract.loss_scale is None and contract.fp8_state == ()


def test_write_of_what_was_read_changes_no_byte(gpt_step: ir.Model) -> None:
    before = ir.to_proto(gpt_step).SerializeToString()
    model = _copy(gpt_step)
    StepContract.read(model).write(model)
    assert ir.to_proto(model).SerializeToString() == before
    # Written into a graph without the record, the keys come back in the same order.
    for key in list(model.metadata_props):
        del model.metadata_props[key]
    StepContract.read(gpt_step).write(model)
    assert list(model.metadata_props.items()) == list(gpt_step.metadata_props.items())


def test_loss_scaling_records_its_state_and_nothing_else(gpt_step: ir.Model) -> None:
    scaled = mpgraph.convert(_copy(gpt_step), "fp16")
    contract, before = StepContract.read(scaled), StepContract.read(gpt_step)
    assert contract.loss_scale == LossScaleState("found_inf", md.LOSS_SCALE, md.GROWTH_TRACKER)
    assert contract.state_pairs[: len(before.state_pairs)] == before.state_pairs
    assert {a for a, _ in contract.state_pairs[len(before.state_pairs):]} == {md.LOSS_SCALE, md.GROWTH_TRACKER}
    assert dataclasses.replace(contract, state_pairs=before.state_pairs, loss_scale=None) == before


def test_a_graph_saved_before_the_newer_keys_reads_as_it_did(gpt_step: ir.Model) -> None:
    """No ``mpgraph.logits``, ``mpgraph.loss`` or ``mpgraph.loss_scale_state``: the logits are
    the value named ``logits``, the loss the output named ``loss``, the loss-scale state the
    names loss scaling gives it."""
    old = mpgraph.convert(_copy(gpt_step), "fp16")
    for key in (md.MODEL_LOGITS, md.MODEL_LOSS, md.MODEL_LOSS_SCALE_STATE, md.MODEL_FORWARD_OUTPUTS):
        del old.metadata_props[key]
    contract = StepContract.read(old)
    assert (contract.logits, contract.loss, contract.forward_outputs) == ("logits", "loss", None)
    assert contract.loss_scale == LossScaleState("found_inf", md.LOSS_SCALE, md.GROWTH_TRACKER)


def test_not_a_step_graph_is_refused() -> None:
    with pytest.raises(ValueError, match="not a training step graph"):
        StepContract.read(ir.from_proto(mpgraph.io.as_proto(str(ZOO / "tiny_mlp.onnx"))))


def test_split_step_graph_takes_the_contract_names(gpt_step: ir.Model) -> None:
    contract = StepContract.read(gpt_step)
    split = split_step_graph(gpt_step)
    assert split.loss == contract.loss and split.state_pairs == contract.state_pairs
    assert split.data_inputs == contract.data_inputs
    assert [p for p, _ in split.gradients] == [p for p, _ in contract.gradients or ()]


def test_the_loss_scale_state_reads_from_a_step_graph_and_from_its_apply_part(gpt_step: ir.Model) -> None:
    """The lowering finds the unscale from ``found_inf``; the split's apply part keeps the
    loss-scale record but no state pairs, so ``StepContract.read`` refuses it."""
    scaled = mpgraph.convert(_copy(gpt_step), "fp16")
    assert LossScaleState.read(scaled) == StepContract.read(scaled).loss_scale
    apply = split_step_graph(scaled).apply
    assert not StepContract.recorded(apply)
    assert LossScaleState.read(apply) == LossScaleState("found_inf", md.LOSS_SCALE, md.GROWTH_TRACKER)
    assert LossScaleState.read(gpt_step) is None


def test_the_strict_check_names_the_key_and_the_fault(gpt_step: ir.Model) -> None:
    """``check_recorded`` (what ``mpgraph.io.check_metadata`` runs on every loaded file) takes
    the built graph and refuses each contract key broken in one way, naming key and value."""
    graph = gpt_step.graph
    inputs, outputs = {v.name for v in graph.inputs}, {v.name for v in graph.outputs}
    values = inputs | set(graph.initializers) | {v.name for n in graph for v in n.outputs}
    props = dict(gpt_step.metadata_props)
    check_recorded(props, inputs=inputs, outputs=outputs, values=values)
    param = StepContract.read(gpt_step).state_pairs[0][0]
    broken = {
        md.MODEL_STATE_PAIRS: (f'[["{param}", "nowhere"]]', "names 'nowhere', which is not a graph output"),
        md.MODEL_GRADIENTS: ('[["nowhere", "loss"]]', "names 'nowhere', which is not a graph input"),
        md.MODEL_LOSS: ("nowhere", "names 'nowhere', which is not a value of the graph"),
        md.MODEL_TRAINING: ("yes", "should be true or false, got 'yes'"),
        md.MODEL_LOSS_SCALE_STATE: ('{"found_inf": "loss"', "is not valid JSON"),
    }
    for key, (text, message) in broken.items():
        with pytest.raises(ValueError, match=f"metadata '{key}' {message}"):
            check_recorded({**props, key: text}, inputs=inputs, outputs=outputs, values=values)


def test_what_a_pass_asks_of_the_record(gpt_step: ir.Model) -> None:
    model = _copy(gpt_step)
    assert StepContract.is_training(model) and not LossScaleState.recorded(model)
    assert StepContract.missing(model, "gradients", "grad_seed", "state_pairs") == []
    del model.metadata_props[md.MODEL_GRAD_SEED]
    model.metadata_props[md.MODEL_TRAINING] = "false"
    assert StepContract.missing(model, "gradients", "grad_seed", "state_pairs") == [md.MODEL_GRAD_SEED]
    assert not StepContract.is_training(model)
    assert LossScaleState.recorded(mpgraph.convert(_copy(gpt_step), "fp16"))
