"""In-place state updates (``Trainer(inplace_state=...)``, ``mpgraph._ir.inplace``): one buffer
per state value where the update provably is the last reader of the old value; the same bits
as two buffer sets; refused, with a log line, where another reader may run after the update;
what ``estimate_memory`` then counts."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir
import pytest

import mpgraph
from mpgraph._ir.inplace import inplace_pairs
from mpgraph.audit.memory import estimate_memory
from mpgraph.audit.ort_alloc import ARENA_INITIAL_CHUNK, POWER_OF_TWO, Buffer, arena_bytes
from mpgraph.errors import TrainingError, UsageError
from mpgraph.runtime.trainer import Trainer

TINY = "models/onnx/tiny_mlp.loss.onnx"  # 4-64-64-2, AdamW state: 6 parameters, flat m and v, step
STEPS = 4


@pytest.fixture(scope="module")
def step() -> ir.Model:
    return mpgraph.build_training_graph(TINY, optimizer="adamw", lr=0.05)


@pytest.fixture(scope="module")
def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((16, 4)).astype(np.float32), "label": rng.integers(0, 2, 16)}
            for _ in range(STEPS)]


def with_late_reader(step: ir.Model, state: str) -> ir.Model:
    """``step`` plus an output ``ReduceSum(state)`` that no update needs: ORT may run it after
    the update, so ``state`` must keep two buffers."""
    model = ir.from_proto(ir.to_proto(step))
    value = next(v for v in model.graph.inputs if v.name == state)
    node = ir.node("ReduceSum", [value], name="late_reader")
    node.outputs[0].name = "late_sum"
    model.graph.append(node)
    model.graph.outputs.append(node.outputs[0])
    return model


def train(step: ir.Model, batches: list[dict[str, np.ndarray]], **options: object) -> tuple[Trainer, list[float]]:
    trainer = Trainer(step, provider="cpu", threads=1, **options)
    return trainer, [trainer.step(b).loss for b in batches]


def shared(trainer: Trainer) -> set[str]:
    """State values whose two sets are one device buffer."""
    sets = trainer.executor.sets
    return {n for n, _ in trainer.pairs if sets[0][n].data_ptr() == sets[1][n].data_ptr()}


@pytest.mark.parametrize("kernels", [False, True], ids=["onnx-adamw", "fused-adamw"])
def test_in_place_trains_the_same_bits_as_two_sets(step, batches, kernels):
    """Both the ONNX AdamW (``p' = Sub(Mul(p, d), u)``) and mpgraph's fused ``AdamWUpdate``
    (reads p, m, v of an element, then writes them) update in place; 4 steps, every state
    value and loss equal bit for bit. The scalar step counter keeps two buffers."""
    two, two_losses = train(step, batches, kernels=kernels, inplace_state=False)
    one, one_losses = train(step, batches, kernels=kernels, inplace_state=True)
    state_names = {n for n, _ in one.pairs}
    assert one.inplace == shared(one) == state_names - {"optim/step"} and one.inplace_reason == ""
    assert shared(two) == set() and two.inplace == frozenset()
    assert one_losses == two_losses
    for name, value in two.state.items():
        assert np.array_equal(one.state[name], value), name


def test_a_reader_after_the_update_keeps_two_buffers_and_says_why(step, batches, caplog):
    graph = with_late_reader(step, "fc1.weight")
    with caplog.at_level(logging.WARNING, logger="mpgraph.runtime.executor"):
        one, one_losses = train(graph, batches, inplace_state=True)
    assert "fc1.weight" not in one.inplace and "fc1.weight" not in shared(one)
    assert {"fc2.weight", "optim/flat/m"} <= one.inplace == shared(one)
    assert "1 of 8 state values keep two buffers" in caplog.text and "'late_reader' (ReduceSum)" in caplog.text
    assert "late_reader" in one.inplace_reason
    two, two_losses = train(graph, batches, inplace_state=False)
    assert one_losses == two_losses
    assert all(np.array_equal(one.state[n], v) for n, v in two.state.items())


def adamw_graph(late_reader: bool) -> ir.Graph:
    """``AdamWUpdate(p, g0 + Identity(p), m, v, ...)``, with a ``Neg`` of the view as a second
    output when ``late_reader``: the Identity is the update's ancestor, the Neg is not."""
    f = ir.TensorType(ir.DataType.FLOAT)
    p, g0, m, v = (ir.Value(name=n, type=f, shape=ir.Shape([8])) for n in ("p", "g0", "m", "v"))
    scalars = [ir.Value(name=f"s{k}", type=f, shape=ir.Shape([])) for k in range(7)]
    view = ir.node("Identity", [p], name="view")
    grad = ir.node("Add", [g0, view.outputs[0]], name="grad")
    adamw = ir.node("AdamWUpdate", [p, grad.outputs[0], m, v, *scalars], domain="ai.mpgraph", num_outputs=3,
                    name="adamw")
    for out, name in zip(adamw.outputs, ("p_new", "m_new", "v_new")):
        out.name = name
    late = [ir.node("Neg", [view.outputs[0]], name="late")] if late_reader else []
    return ir.Graph([p, g0, m, v, *scalars], [*adamw.outputs, *(n.outputs[0] for n in late)],
                    nodes=[view, grad, adamw, *late])


def test_inplace_pairs_follow_slots_views_and_ancestry():
    """The fused AdamW writes p into p' and m into m': a pair (m, p') is not elementwise; a
    view of the state read after the update is a late reader as well."""
    pairs = [("p", "p_new"), ("m", "m_new"), ("v", "v_new")]
    assert inplace_pairs(adamw_graph(False), pairs) == (["p", "m", "v"], {})
    assert "not elementwise" in inplace_pairs(adamw_graph(False), [("m", "p_new")])[1]["m"]
    assert inplace_pairs(adamw_graph(True), pairs) == (["m", "v"], {
        "p": "node 'late' (Neg) reads it and may run after its update 'adamw' (AdamWUpdate)"})


def test_fit_cannot_undo_an_in_place_step(step, batches):
    """A NaN weight makes the first loss NaN: two sets go back to the state before it (and
    raise as ``on_nonfinite='stop'`` says); in place there is nothing to go back to."""
    nan_state = {n: a.copy() for n, a in Trainer(step, provider="cpu", threads=1).state.items()}
    nan_state["fc1.weight"][0, 0] = np.nan
    with pytest.raises(TrainingError, match="the state is that of step 0"):
        Trainer(step, provider="cpu", threads=1, state=nan_state, inplace_state=False).fit(batches, steps=2)
    with pytest.raises(TrainingError, match=r"step 1: .*updated in place"):
        Trainer(step, provider="cpu", threads=1, state=nan_state, inplace_state=True).fit(batches, steps=2)


def test_defaults_and_conflicts(step):
    trainer = Trainer(step, provider="cpu", threads=1)
    assert trainer.inplace == frozenset() and "a CUDA default" in trainer.inplace_reason
    with pytest.raises(UsageError, match="exclude each other"):
        Trainer(step, provider="cpu", threads=1, inplace_state=True, pipeline=True)


def test_estimate_counts_one_buffer_per_in_place_value(step):
    """In place, the output set holds only what stays in two sets: the step counter and the
    loss; every other state output is ``inplace_bytes``, which a third set does not copy."""
    bf16 = mpgraph.convert(ir.from_proto(ir.to_proto(step)), "bf16")  # convert rewrites its argument
    two, one = estimate_memory(bf16, batch=64), estimate_memory(bf16, batch=64, inplace=True)
    state = one.role_bytes["master_weights"] + one.role_bytes["optimizer_state"]
    assert one.inplace_bytes == state == 4 * 3 * one.parameters and one.inplace_refused == {}
    assert two.output_bytes - one.output_bytes == state
    assert two.estimated_peak_bytes - one.estimated_peak_bytes == state
    assert estimate_memory(bf16, batch=64, inplace=True, state_sets=3).extra_state_set_bytes == one.other_state_bytes
    late = estimate_memory(with_late_reader(bf16, "fc1.weight"), batch=64, inplace=True)
    assert list(late.inplace_refused) == ["fc1.weight"] and "late_reader" in late.inplace_refused["fc1.weight"]
    assert late.inplace_bytes == state - 4 * 4 * 64


def test_power_of_two_arena_grows_in_doubling_regions():
    """ORT's default growth: a 1 MiB region first, then 2 MiB, then 4 MiB (each extension
    doubles the next one's size): 7 MiB for requests of 0.75 + 0.75 + 3 MiB, which
    ``kSameAsRequested`` takes as they are."""
    kib = 1024
    buffers = [Buffer("a", 0, 2, 768 * kib), Buffer("b", 1, 2, 768 * kib), Buffer("c", 1, 2, 3 * 1024 * kib)]
    assert arena_bytes(buffers) == (768 + 768 + 3 * 1024) * kib
    assert arena_bytes(buffers, POWER_OF_TWO) == ARENA_INITIAL_CHUNK * (1 + 2 + 4)


def test_recorded_shapes_of_a_specialised_plan_give_the_inferred_numbers(step):
    """``recorded_shapes=True`` (a session plan, whose fused ops ONNX cannot infer) reads the
    shapes the specialised graph carries: the same numbers as ONNX shape inference of it."""
    from mpgraph.io import as_model
    from mpgraph.lowering import PlanOptions, plan_session

    plan = plan_session(step, "cpu", PlanOptions(kernels=False, shapes={"x": (16, 4), "label": (16,)}))
    graph = as_model(plan.graph)
    recorded, inferred = estimate_memory(graph, recorded_shapes=True), estimate_memory(graph, batch=16)
    assert dataclasses.replace(recorded, batch=16) == inferred and recorded.unknown_shapes == 0
    assert recorded.arena_strategy == "kSameAsRequested" and recorded.first_step_arena_bytes > 0


def test_data_parallel_refuses_in_place(step):
    from mpgraph.runtime.options import RunOptions
    from mpgraph.runtime.parallel_trainer import DataParallelTrainer

    with pytest.raises(UsageError, match="one-device Trainer"):
        DataParallelTrainer(step, RunOptions(threads=1, inplace_state=True))


def test_cli_audit_memory_inplace(tmp_path):
    """``audit --memory --inplace``: the in-place bytes in the JSON and a row in the table."""
    import json

    from typer.testing import CliRunner

    from mpgraph.cli.main import app

    two = CliRunner().invoke(app, ["audit", TINY, "--memory", "--json"])
    one = CliRunner().invoke(app, ["audit", TINY, "--memory", "--inplace", "--json"])
    assert two.exit_code == 0 and one.exit_code == 0, one.output
    saved = json.loads(one.output)["inplace_bytes"]
    assert saved > 0 and json.loads(two.output)["output_bytes"] - json.loads(one.output)["output_bytes"] == saved
    table = CliRunner().invoke(app, ["audit", TINY, "--memory", "--inplace"])
    assert table.exit_code == 0 and "state updated in place" in table.output
    assert CliRunner().invoke(app, ["audit", TINY, "--inplace"]).exit_code != 0  # only with --memory


def test_cli_train_inplace_state(tmp_path):
    """``mpgraph train --inplace-state``: the summary line says how many values were in place."""
    from mpgraph.io import save_model
    from tests.helpers import mpgraph_cli

    path = tmp_path / "tiny.step.onnx"
    save_model(mpgraph.build_training_graph(TINY, optimizer="adamw"), str(path))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, label=(x[:, 0] > 0).astype(np.int64))
    result = mpgraph_cli("train", str(path), "--data", str(tmp_path / "data.npz"), "--steps", "2", "--batch", "16", "-q",
                         "--threads", "1", "--inplace-state")
    assert result.returncode == 0, result.stderr
    assert "state in place (8 of 9 values)" in result.stdout


def test_inplace_pairs_do_not_need_a_sorted_graph():
    """The ancestry is built over a topological order of its own: the same answer with the
    nodes listed backwards."""
    graph = adamw_graph(True)
    nodes = list(graph)
    for node in nodes:
        graph.remove(node)
    graph.extend(reversed(nodes))
    assert inplace_pairs(graph, [("p", "p_new"), ("m", "m_new")]) == (["m"], {
        "p": "node 'late' (Neg) reads it and may run after its update 'adamw' (AdamWUpdate)"})


def test_state_sets_on_cuda_grow_by_powers_of_two():
    """Three 600 MiB state buffers from a power-of-two arena: the first request doubles the
    1 MiB region size up to 1 GiB, where it stays (``max_power_of_two_extend_bytes``); no
    1 GiB region holds two of them: 3 GiB for 1.76. One set of the second value (in place)
    is one region less."""
    from mpgraph.audit.memory import state_arena_bytes
    from mpgraph.audit.ort_alloc import POWER_OF_TWO

    mib = 1 << 20
    assert state_arena_bytes([600 * mib, 600 * mib], [2, 1], POWER_OF_TWO) == 3 * 1024 * mib
    assert state_arena_bytes([600 * mib, 600 * mib], [1, 1], POWER_OF_TWO) == 2 * 1024 * mib


def test_state_sets_on_cuda_take_what_they_need_as_the_trainer_sets_the_arena():
    """The Trainer makes the device-value arena grow as requested (``exact_device_values``):
    the same three 600 MiB buffers take 1800 MiB, one set of the second 1200."""
    from mpgraph.audit.memory import state_arena_bytes

    mib = 1 << 20
    assert state_arena_bytes([600 * mib, 600 * mib], [2, 1]) == 1800 * mib
    assert state_arena_bytes([600 * mib, 600 * mib], [1, 1]) == 1200 * mib


def test_unsharing_mid_run_keeps_the_values_and_the_bits(step, batches):
    """What the executor does when a new session's plan (the capturing one, on CUDA) refuses a
    value: it gets a buffer per set again, holding the same values, and training goes on as
    with two sets from the start."""
    two, two_losses = train(step, batches, inplace_state=False)
    one = Trainer(step, provider="cpu", threads=1, inplace_state=True)
    losses = [one.step(b).loss for b in batches[:1]]  # an odd number of steps on either side
    one.executor._unshare(frozenset({"fc1.weight", "optim/flat/m"}))
    assert {"fc1.weight", "optim/flat/m"}.isdisjoint(shared(one) | one.inplace) and "fc2.weight" in shared(one)
    losses += [one.step(b).loss for b in batches[1:]]
    assert losses == two_losses
    assert all(np.array_equal(one.state[n], v) for n, v in two.state.items())


class _CapturingSession:
    """A CPU session that behaves as ORT's CUDA-graph sessions are taken to: the ``capture``-th
    run of each graph id runs the step ``repeats`` times (the runs before the capture, then the
    captured graph), every other run once."""

    def __init__(self, session, repeats: int, capture: int) -> None:
        self._session, self._repeats, self._capture = session, repeats, capture
        self._runs: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, binding, options=None) -> None:
        graph = options.get_run_config_entry("gpu_graph_id") if options is not None else ""
        self._runs[graph] = self._runs.get(graph, 0) + 1
        for _ in range(self._repeats if self._runs[graph] == self._capture else 1):
            self._session.run_with_iobinding(binding, options)


@pytest.mark.parametrize(("inplace", "capture"), [(False, 1), (True, 1), (True, 2)])
def test_a_capturing_run_that_repeats_the_step_trains_as_two_sets(step, batches, monkeypatch, inplace, capture):
    """The captured-graph path on ORT CPU, its session standing in for one whose first (or
    second) run per graph runs the step three times: two sets are unaffected (each run writes
    the same outputs from the same inputs); in place the executor runs a graph's first launch
    SYNC_RUNS_PER_GRAPH times, puts the state back and runs the graph once more, so the losses
    and state equal a plain two-set run's bit for bit (without the put-back, the first loss is
    already another)."""
    from mpgraph.runtime import executor as ex

    want, want_losses = train(step, batches, inplace_state=False)
    real = ex.providers.new_session

    def capturing(*args, cuda_graph: bool = False, **kwargs):
        return _CapturingSession(real(*args, **kwargs), 3, capture) if cuda_graph else real(*args, **kwargs)

    monkeypatch.setattr(ex.providers, "new_session", capturing)
    trainer = Trainer(step, provider="cpu", threads=1, inplace_state=inplace)
    trainer.executor._want_graph = True  # the captured-graph path, as on CUDA
    losses = [trainer.step(b).loss for b in batches]
    assert trainer.executor.replay is not None and bool(trainer.inplace) == inplace
    assert losses == want_losses
    for name, value in want.state.items():
        np.testing.assert_array_equal(trainer.state[name], value, err_msg=name)
