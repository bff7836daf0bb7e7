"""split_step_graph: gradient part then apply part equals the whole step, bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.errors import MpgraphError
from mpgraph.training import build_training_graph
from mpgraph.training.shard_flat_slot import flat_slots, slice_range
from mpgraph.training.split_step_graph import optimizer_groups, shard_apply_part, split_step_graph
from tests.helpers import run_named


@functools.cache
def _step_bytes(name: str, policy: str | None) -> bytes:
    step = build_training_graph(f"models/onnx/{name}.loss.onnx", optimizer="adamw")
    if policy is not None:
        step = mpgraph.convert(step, policy, emulate=True)
    return ir.to_proto(step).SerializeToString()


def _step(name: str, policy: str | None) -> ir.Model:
    return ir.from_proto(onnx.load_from_string(_step_bytes(name, policy)))


def _batch(name: str, rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
    if name == "gpt":
        return {"tokens": rng.integers(0, 64, (batch, 16)), "label": rng.integers(0, 64, (batch, 16))}
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32), "label": rng.integers(0, 2, batch)}


def _run_split(split, feeds: dict[str, np.ndarray]) -> tuple[dict, dict]:
    grads = run_named(split.gradient, feeds)
    wanted = {v.name for v in split.apply.graph.inputs}
    return grads, run_named(split.apply, {k: v for k, v in grads.items() if k in wanted})


@pytest.mark.parametrize("policy", [None, "fp16"])
@pytest.mark.parametrize("name", ["tiny_mlp", "gpt"])
def test_gradient_then_apply_is_the_step_bit_for_bit(name, policy):
    step = _step(name, policy)
    split = split_step_graph(step)
    feeds = _batch(name, np.random.default_rng(0), 4)
    whole = run_named(step, feeds)
    grads, applied = _run_split(split, feeds)
    assert set(applied) | {split.loss} == set(whole)
    for out, value in applied.items():
        np.testing.assert_array_equal(value, whole[out], err_msg=out)
    np.testing.assert_array_equal(grads[split.loss], whole[split.loss])
    # The contract: data only in the gradient part, gradients cross in float32, every state
    # output comes from the apply part.
    assert split.data_inputs == tuple(feeds)
    assert not set(split.data_inputs) & {v.name for v in split.apply.graph.inputs}
    assert all(grads[g].dtype == np.float32 for _, g in split.gradients)
    assert {o for _, o in split.state_pairs} <= set(applied)
    if policy == "fp16":
        assert md.LOSS_SCALE in {v.name for v in split.gradient.graph.inputs}  # the scaled seed
        assert md.FOUND_INF in applied


def test_overflow_is_found_from_the_gradients_the_apply_part_is_fed():
    """An inf fed as a reduced gradient skips the step and backs the scale off; the model
    computed from the batch had no inf: the flag is the apply part's, from its inputs."""
    split = split_step_graph(_step("tiny_mlp", "fp16"))
    grads, applied = _run_split(split, _batch("tiny_mlp", np.random.default_rng(0), 4))
    assert not applied[md.FOUND_INF]
    param, name = split.gradients[3]
    grads[name] = grads[name].copy()
    grads[name].flat[0] = np.inf
    wanted = {v.name for v in split.apply.graph.inputs}
    skipped = run_named(split.apply, {k: v for k, v in grads.items() if k in wanted})
    assert skipped[md.FOUND_INF]
    initial = {v.name: v.const_value.numpy() for v in split.apply.graph.inputs if v.const_value is not None}
    np.testing.assert_array_equal(skipped[f"{param}/updated"], initial[param])
    assert skipped[f"{md.LOSS_SCALE}/updated"] == initial[md.LOSS_SCALE] / 2


def test_state_made_from_the_batch_is_refused():
    step = build_training_graph("models/onnx/resnet.loss.onnx", optimizer="sgd")
    with pytest.raises(MpgraphError, match="differ between ranks.*--batchnorm eval"):
        split_step_graph(step)


def test_a_gradient_graph_without_optimizer_is_refused():
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer=None)
    with pytest.raises(MpgraphError, match="with an optimizer"):
        split_step_graph(step)


def test_optimizer_groups_pair_each_parameter_with_its_moments():
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw", optimizer_options={"pack": False})
    groups, scalar = optimizer_groups(split_step_graph(step))
    assert scalar == ("optim/step",)
    assert groups[0] == ("fc1.weight", "optim/fc1.weight/m", "optim/fc1.weight/v")
    assert sorted(g[0] for g in groups) == sorted(p for p in {n for g in groups for n in g} if not p.startswith("optim/"))
    assert len(groups) == 6 and all(len(g) == 3 for g in groups)
    # Packed (the default for small parameters): one slot, one group.
    packed, _ = optimizer_groups(split_step_graph(_step("tiny_mlp", "fp16")))
    assert len(packed) == 1 and {"optim/flat/m", "fc3.bias"} <= set(packed[0])


def test_a_shard_of_the_apply_part_updates_its_groups_like_the_whole():
    step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw", optimizer_options={"pack": False})
    split = split_step_graph(step)
    grads, applied = _run_split(split, _batch("tiny_mlp", np.random.default_rng(0), 4))
    shard = shard_apply_part(split, {"fc2.weight/updated", "optim/fc2.weight/m/updated", "optim/fc2.weight/v/updated",
                                     "optim/step/updated"})
    inputs = {v.name for v in shard.graph.inputs}
    assert {"fc2.weight", "optim/fc2.weight/m"} <= inputs and "optim/fc1.weight/m" not in inputs
    part = run_named(shard, {k: v for k, v in grads.items() if k in inputs})
    assert set(part) == {"fc2.weight/updated", "optim/fc2.weight/m/updated", "optim/fc2.weight/v/updated", "optim/step/updated"}
    for name, value in part.items():
        np.testing.assert_array_equal(value, applied[name])


def test_a_packed_slot_updated_in_slices_is_the_whole_update_bit_for_bit():
    """fp16 loss-scaled AdamW packs the MLP's 6 parameters into one slot of 4,610 elements:
    3 ranks' slices of the moments and of the new flat parameter, put together, are the whole
    apply part's outputs."""
    split = split_step_graph(_step("tiny_mlp", "fp16"))
    params = {p for p, _ in split.gradients}
    (slot,) = flat_slots(split.apply, list(split.state_pairs), params)
    assert slot.state == ("optim/flat/m", "optim/flat/v") and slot.size == 4610 and len(slot.members) == 6
    grads, whole = _run_split(split, _batch("tiny_mlp", np.random.default_rng(0), 4))
    rng = np.random.default_rng(1)
    moments = {n: rng.random(slot.size, dtype=np.float32) * 1e-3 for n in slot.state}  # not the zeros they start at
    wanted = {v.name for v in split.apply.graph.inputs}
    whole = run_named(split.apply, {**{k: v for k, v in grads.items() if k in wanted}, **moments})
    outputs = {o for a, o in split.state_pairs if a not in params}
    parts: dict[str, list[np.ndarray]] = {}
    for rank in range(3):
        start, end = slice_range(slot.size, rank, 3)
        shard = shard_apply_part(split, outputs, [slot], rank, 3)
        inputs = {v.name for v in shard.graph.inputs}
        got = run_named(shard, {**{k: v for k, v in grads.items() if k in inputs},
                                **{k: v[start:end] for k, v in moments.items()}})
        assert not {f"{p}/updated" for p in params} & set(got)  # the runner gathers the parameters
        for name, value in got.items():
            parts.setdefault(name, []).append(value)
    for name in ("optim/flat/m/updated", "optim/flat/v/updated"):
        np.testing.assert_array_equal(np.concatenate(parts[name]), whole[name])
    flat = np.concatenate(parts[slot.output])
    np.testing.assert_array_equal(flat, np.concatenate([whole[f"{p}/updated"].ravel() for p, _ in slot.members]))
    assert all(np.array_equal(v, parts[md.FOUND_INF][0]) for v in parts[md.FOUND_INF])
