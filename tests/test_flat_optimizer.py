"""The flat optimizer (``optimizer_options={"flat": True}``): one update over flat buffers.

The flat form runs the same elementwise ops, in the same order, on the same values as the
per-tensor form, only laid out in one buffer; ORT CPU's elementwise kernels round each element
on its own, so the two agree bit for bit (checked exactly, stronger than the 1e-6 asked for).
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.optim import base
from mpgraph.policy import parse_policy
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner

ZOO_DIR = Path(__file__).resolve().parents[1] / "models" / "onnx"

CONFIGS = {
    "sgd-nesterov-wd": ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}, 0.1),
    "sgd-dampening": ("sgd", {"momentum": 0.9, "dampening": 0.5}, 0.1),
    "adam-wd": ("adam", {"weight_decay": 1e-2}, 1e-2),
    "adamw-amsgrad": ("adamw", {"amsgrad": True}, 1e-2),
    "adamw-no-decay": ("adamw", {"weight_decay": 0.0}, 1e-2),
}


def deep_mlp(layers: int = 20, width: int = 8) -> onnx.ModelProto:
    """``layers`` x (MatMul, Add, Tanh): 2 * layers parameters, more than the 32 inputs ORT's
    CUDA Concat takes under CUDA graph capture, so the flat buffers are built as trees."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(layers):
        weights += [numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"w{i}"),
                    numpy_helper.from_array(np.full(width, 0.1, np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Tanh", [f"a{i}"], [f"h{i}"], name=f"tanh{i}")]
        x = f"h{i}"
    graph = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _step(name: str, kind: str, options: dict) -> ir.Model:
    """A fresh copy of the step graph, built once per process and ``FLAT_UNPACK`` (which shapes
    only the flat form): the cases share most of their graphs, and Trainer may edit its own."""
    unpack = base.FLAT_UNPACK if options.get("flat") else None
    return ir.from_proto(onnx.load_from_string(_step_bytes(name, kind, json.dumps(options, sort_keys=True), unpack)))


@functools.cache
def _step_bytes(name: str, kind: str, options: str, unpack: str | None) -> bytes:
    assert unpack in (None, base.FLAT_UNPACK)
    if name == "deep_mlp":
        model = build_training_graph(deep_mlp(), optimizer=kind, loss="mse", optimizer_options=json.loads(options))
    else:
        model = build_training_graph(ZOO_DIR / f"{name}.loss.onnx", optimizer=kind, optimizer_options=json.loads(options))
    return ir.to_proto(model).SerializeToString()


def _feeds(name: str, steps: int, batch: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    if name == "deep_mlp":
        return [{"x": rng.standard_normal((batch, 8)).astype(np.float32),
                 "label": rng.standard_normal((batch, 8)).astype(np.float32)} for _ in range(steps)]
    if name == "gpt":
        return [{"tokens": rng.integers(0, 64, (batch, 16)).astype(np.int64),
                 "label": rng.integers(0, 64, (batch, 16)).astype(np.int64)} for _ in range(steps)]
    width, classes = {"tiny_mlp": (4, 2), "wide_mlp": (1024, 10)}[name]
    return [{"x": rng.standard_normal((batch, width)).astype(np.float32),
             "label": rng.integers(0, classes, batch).astype(np.int64)} for _ in range(steps)]


def _optimizer_nodes(model: ir.Model) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph if n.metadata_props.get(md.NODE_ROLE) == "optimizer")


def _param_order(model: ir.Model) -> list[str]:
    return [p for p, _ in json.loads(model.metadata_props[md.MODEL_GRADIENTS])]


def _flat_order(model: ir.Model) -> list[str]:
    """The parameters in the order the flat buffers hold them (read off the flat Concat)."""
    def members(node: ir.Node) -> list[str]:
        names = []
        for value in node.inputs:
            producer = value.producer()
            names += members(producer) if producer.op_type == "Concat" else [producer.inputs[0].name]
        return names

    (concat,) = [n for n in model.graph if n.metadata_props.get(md.NODE_FLAT) == md.FLAT_PARAM]
    return members(concat)


#: Both ways back from the flat buffer (``optim.base.FLAT_UNPACK``); ``grouped`` on fewer cases.
CASES = [(name, config, "reshape") for name in ("tiny_mlp", "gpt", "deep_mlp") for config in sorted(CONFIGS)] + [
    (name, "adamw-amsgrad", "grouped") for name in ("tiny_mlp", "gpt", "deep_mlp")]


@pytest.mark.parametrize(("name", "config", "unpack"), CASES)
def test_flat_matches_per_tensor(name: str, config: str, unpack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "FLAT_UNPACK", unpack)
    kind, options, lr = CONFIGS[config]
    per_tensor = _step(name, kind, {**options, "pack": False})
    flat = _step(name, kind, {**options, "flat": True})
    runners = [CpuRunner(m, threads=1, spin=False) for m in (per_tensor, flat)]
    for feeds in _feeds(name, 10):
        losses = [r.step(feeds, lr=lr) for r in runners]
        assert losses[0] == losses[1]
    ours, theirs = runners[0].state, runners[1].state
    params = _param_order(flat)
    for p in params:
        assert np.array_equal(ours[p], theirs[p]), p
    assert not np.array_equal(theirs[params[0]], flat.graph.initializers[params[0]].const_value.numpy())  # it trained
    # Flat state is the per-tensor state concatenated in the flat buffer's order: parameter
    # order, or (``grouped``) grouped by trailing dims, in parameter order within a group.
    order = _flat_order(flat)
    assert order == params if unpack == "reshape" else sorted(order) == sorted(params)
    slots = {k.split("/")[-1] for k in theirs if k.startswith("optim/flat/")}
    assert slots == {"momentum"} if kind == "sgd" else slots >= {"m", "v"}
    assert ("v_max" in slots) == bool(options.get("amsgrad"))
    for slot in slots:
        expected = np.concatenate([ours[f"optim/{p}/{slot}"].ravel() for p in order])
        assert np.array_equal(theirs[f"optim/flat/{slot}"], expected), slot
    if "optim/step" in ours:
        assert ours["optim/step"] == theirs["optim/step"] == 10.0


@pytest.mark.parametrize("unpack", ["reshape", "grouped"])
def test_flat_node_count_is_independent_of_parameter_count(unpack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flat update is the same nodes for 6 parameters (tiny MLP) as for 30 (GPT), apart
    from the Reshapes (two views per parameter; back: one copy per non-vector, or, grouped,
    one view per group of equal trailing dims) and the Splits (one, or one per group)."""
    monkeypatch.setattr(base, "FLAT_UNPACK", unpack)
    counts, per_tensor = {}, {}
    for name in ("tiny_mlp", "wide_mlp", "gpt"):
        path = ZOO_DIR / f"{name}.loss.onnx"
        model = build_training_graph(path, optimizer="adamw", optimizer_options={"amsgrad": True, "flat": True})
        flat = _optimizer_nodes(model)
        params = [v for v in model.graph.inputs if v.name in set(_param_order(model))]
        groups = collections.Counter(tuple(v.shape[1:]) for v in params)
        if unpack == "grouped":
            assert flat["Reshape"] == 2 * len(params) + len(set(groups) - {()})
            assert flat["Split"] == (len(groups) > 1) + sum(n > 1 for n in groups.values())
        else:
            assert flat["Reshape"] == 2 * len(params) + sum(len(v.shape) != 1 for v in params)
            assert flat["Split"] == 1
        del flat["Reshape"], flat["Split"]
        counts[name] = flat
        per_tensor[name] = sum(_optimizer_nodes(build_training_graph(path, optimizer="adamw", optimizer_options={"amsgrad": True, "pack": False})).values())
    assert counts["tiny_mlp"] == counts["wide_mlp"] == counts["gpt"], counts
    assert counts["gpt"]["Concat"] == 2
    # 2 Concat, 15 elementwise ops on the flat buffers (Max for amsgrad), 13 scalar ops for
    # the step counter and bias corrections, and the 3 coefficient Constants loss scaling may
    # gate (1 - beta1, beta2, 1 - beta2).
    assert sum(counts["gpt"].values()) == 33
    assert per_tensor["gpt"] > 4 * per_tensor["tiny_mlp"]  # what the flat form removes


def _fp16(init: float, mode: str = "dynamic"):
    return parse_policy(f"extends: fp16\nloss_scaling: {{mode: {mode}, init: {init}, growth_interval: 2000}}\n", "test.yaml")


def _loss_scaled(name: str, flat: bool) -> ir.Model:
    """A fresh copy of the fp16-emulated, dynamically loss-scaled AdamW (amsgrad) step."""
    return ir.from_proto(onnx.load_from_string(_loss_scaled_bytes(name, flat, base.FLAT_UNPACK if flat else None)))


@functools.cache
def _loss_scaled_bytes(name: str, flat: bool, unpack: str | None) -> bytes:
    step = _step(name, "adamw", {"amsgrad": True, **({"flat": True} if flat else {"pack": False})})
    return ir.to_proto(mpgraph.convert(step, _fp16(1024.0), emulate=True)).SerializeToString()


def test_flat_loss_scaling_is_a_handful_of_nodes() -> None:
    """Unscale, finite check and skip: one Mul, one ReduceSum and one big Where for the flat
    gradient, whatever the parameter count; converting again changes nothing."""
    added = {}
    for name in ("tiny_mlp", "gpt", "deep_mlp"):
        before = collections.Counter(n.op_type for n in _step(name, "adamw", {"amsgrad": True, "flat": True}).graph)
        model = _loss_scaled(name, flat=True)
        after = collections.Counter(n.op_type for n in model.graph)
        added[name] = {op: after[op] - before[op] for op in ("Where", "ReduceSum", "Mul", "IsNaN")}
        again = mpgraph.convert(model, _fp16(1024.0), emulate=True)
        assert ir.to_proto(again).SerializeToString() == ir.to_proto(model).SerializeToString()
    # Where: the flat gradient zeroed on overflow, the 5 gated Adam coefficients and the step
    # counter (scalars), and 4 for the dynamic scale; Mul: seed, unscale, nan probe, scale growth and backoff.
    assert added["tiny_mlp"] == added["gpt"] == added["deep_mlp"] == {"Where": 11, "ReduceSum": 1, "Mul": 5, "IsNaN": 1}


@pytest.mark.parametrize(("name", "unpack"), [("tiny_mlp", "reshape"), ("gpt", "reshape"), ("deep_mlp", "reshape"),
                                              ("gpt", "grouped"), ("deep_mlp", "grouped")])
def test_flat_loss_scaled_step_matches_per_tensor_and_skips_bit_identically(name: str, unpack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16-emulated, dynamic loss scaling: the flat step equals the per-tensor step; a
    step whose scaled gradients overflow (loss scale 2**127) leaves every parameter and
    optimizer state bit-identical and halves the scale."""
    monkeypatch.setattr(base, "FLAT_UNPACK", unpack)
    trainers = [Trainer(_loss_scaled(name, flat), provider="cpu", threads=1) for flat in (False, True)]
    batches = _feeds(name, 4)
    for feeds in batches[:3]:
        results = [t.step(feeds, lr=1e-2) for t in trainers]
        assert not any(r.skipped for r in results)
        assert results[0].loss == results[1].loss
    ours, theirs = trainers[0].state, trainers[1].state
    for p in _param_order(trainers[1].model):
        assert np.array_equal(ours[p], theirs[p]), p

    huge = {md.LOSS_SCALE: np.array(2.0**127, dtype=np.float32)}
    trainer = Trainer(_loss_scaled(name, flat=True), provider="cpu", threads=1, state={**theirs, **huge})
    before = trainer.state
    assert trainer.step(batches[3], lr=1e-2).skipped
    after = trainer.state
    for key, value in before.items():
        if key not in (md.LOSS_SCALE, md.GROWTH_TRACKER):
            assert np.array_equal(after[key], value), key
    assert float(after[md.LOSS_SCALE]) == 2.0**126
