"""Loss scaling's gated skip (``ScaleLossPass`` rule 4): Adam and AdamW mark their per-step
coefficients (``mpgraph.on_skip``), and an overflowing step then computes the old state from
zeroed gradients instead of selecting it back per state tensor.

The gated and the select form must train the same: every finite step gives bit-identical
state, and a skipped step leaves every state unchanged, for each Adam variant.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx_ir as ir
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.policy import parse_policy
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph

POLICY = "extends: fp16\nloss_scaling: {mode: dynamic, init: 1024, growth_interval: 2}\n"
VARIANTS = {
    "adam": ("adam", {}),
    "adam-l2-amsgrad": ("adam", {"weight_decay": 0.1, "amsgrad": True}),
    "adamw": ("adamw", {"weight_decay": 0.1}),
    "adamw-flat": ("adamw", {"weight_decay": 0.1, "flat": True}),
}
# overflow first (at step 0 the bias corrections are 1 - beta**0 = 0: the skipped update
# must not divide by them), then finite, finite, overflow, finite, overflow, overflow, finite:
# the scale grows, backs off, and the step counter must not advance on the skipped steps.
PATTERN = [True, False, False, True, False, True, True, False]


def _batch(step: int, bad: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    if bad:
        x[0, 0] = np.inf
    return {"x": x, "label": rng.integers(0, 2, 6).astype(np.int64)}


def _step_graph(optimizer: str, options: dict, gated: bool) -> ir.Model:
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer=optimizer, optimizer_options=options)
    if not gated:  # what an optimizer without marked coefficients gets: a select per state
        for node in step.graph:
            node.metadata_props.pop(md.NODE_ON_SKIP, None)
    return mpgraph.convert(step, parse_policy(POLICY), emulate=True)


def _run(model: ir.Model) -> tuple[list[float], list[dict[str, np.ndarray]]]:
    trainer = Trainer(model, provider="cpu")
    losses, states = [], []
    for i, bad in enumerate(PATTERN):
        result = trainer.step(_batch(i, bad), lr=1e-2)
        assert result.skipped == bad
        losses.append(result.loss)
        states.append(trainer.state)
    return losses, states


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gated_skip_trains_exactly_as_the_select_form(variant: str) -> None:
    optimizer, options = VARIANTS[variant]
    gated_losses, gated_states = _run(_step_graph(optimizer, options, gated=True))
    select_losses, select_states = _run(_step_graph(optimizer, options, gated=False))
    np.testing.assert_array_equal(np.array(gated_losses), np.array(select_losses))
    for step, (ours, theirs) in enumerate(zip(gated_states, select_states, strict=True)):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert np.array_equal(ours[name], theirs[name]), (variant, step, name)
    # The skipped steps left the model and the optimizer as they were (the scale moved).
    initial = Trainer(_step_graph(optimizer, options, gated=True), provider="cpu").state
    for step, bad in enumerate(PATTERN):
        if bad:
            previous = gated_states[step - 1] if step else initial
            for name, value in gated_states[step].items():
                if name not in (md.LOSS_SCALE, md.GROWTH_TRACKER):
                    assert np.array_equal(value, previous[name]), (variant, step, name)
    assert float(gated_states[-1]["optim/step"]) == PATTERN.count(False)


def _optimizer_selects(model: ir.Model) -> int:
    return sum(n.op_type == "Where" and n.metadata_props.get(md.NODE_ROLE) == md.Role.OPTIMIZER for n in model.graph)


def test_gated_skip_selects_once_per_gradient_not_per_state() -> None:
    step = build_training_graph("models/onnx/gpt.loss.onnx", optimizer="adamw")
    n_gates = sum(md.NODE_ON_SKIP in n.metadata_props for n in step.graph)
    grads = len(json.loads(step.metadata_props[md.MODEL_GRADIENTS]))
    states = len(json.loads(step.metadata_props[md.MODEL_STATE_PAIRS]))
    model = mpgraph.convert(step, "fp16")
    # step counter (selected back), step size, decay, 1 - beta1, beta2, 1 - beta2
    assert n_gates == 6
    checked = collections.Counter(n.name.endswith("/finite") for n in model.graph if n.op_type == "Where")[True]
    # Every gradient the optimizer reads is zeroed on overflow once: the packed small
    # parameters share one flat gradient, so that is fewer than the parameters.
    assert 0 < checked <= grads
    # the gates, the zeroed gradients, and the dynamic scale's four selects; of the state, only
    # the step counter is selected back
    assert _optimizer_selects(model) == n_gates + checked + 4
    assert [n.name for n in model.graph if n.op_type == "Where" and n.name.endswith("/skip")] == ["loss_scale/optim/step/skip"]
    assert states > checked


def test_sgd_keeps_a_select_per_state() -> None:
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd", optimizer_options={"momentum": 0.9})
    assert not any(md.NODE_ON_SKIP in n.metadata_props for n in step.graph)
    model = mpgraph.convert(step, parse_policy(POLICY), emulate=True)
    skips = [n for n in model.graph if n.op_type == "Where" and n.name.endswith("/skip")]
    assert skips
