"""audit --memory models what ORT does: its execution order and its memory-pattern block."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import helper as h

from mpgraph._ir import meta as md
from mpgraph.audit.memory import (
    ARENA_UNIT,
    PATTERN_ALIGNMENT,
    _arena_bytes,
    _Buffer,
    _pattern_block,
    estimate_memory,
    ort_order,
)
from tests.helpers import make_model, vi


def _step(nodes, inputs, outputs) -> ir.Model:
    model = ir.from_proto(make_model(nodes, inputs, outputs, []))
    model.metadata_props.update({md.MODEL_GRADIENTS: "[]", md.MODEL_STATE_PAIRS: "[]"})
    return model


def test_ort_order_is_the_reverse_depth_first_walk_from_the_last_leaf():
    """File order A, B, C, D with D reading B and C, C reading A: ORT visits D's producer with
    the highest index (C) first, so it runs A, C, B, D; a leaf listed later runs first."""
    nodes = [
        h.make_node("Relu", ["x"], ["a"], name="A"),
        h.make_node("Relu", ["x"], ["b"], name="B"),
        h.make_node("Relu", ["a"], ["c"], name="C"),
        h.make_node("Add", ["b", "c"], ["y"], name="D"),
        h.make_node("Neg", ["x"], ["z"], name="E"),  # a second leaf, after D in the file
    ]
    model = _step(nodes, [vi("x", ["N", 4])], [vi("y", ["N", 4]), vi("z", ["N", 4])])
    assert [n.name for n in ort_order(model)] == ["E", "A", "C", "B", "D"]


def test_liveness_follows_ort_order():
    """x -> A (big) -> C, x -> B (small) -> D(b, c). In file order B's small output waits while A
    and C run; ORT runs A, C first and B last, so at C only a and c are alive, at D b and c."""
    nodes = [
        h.make_node("Tile", ["x", "reps"], ["a"], name="A"),       # [N, 32]
        h.make_node("Relu", ["x"], ["b"], name="B"),                # [N, 4]
        h.make_node("Relu", ["a"], ["c"], name="C"),                # [N, 32]
        h.make_node("ReduceSum", ["c", "axes"], ["c2"], name="R", keepdims=1),  # [N, 1]
        h.make_node("Add", ["b", "c2"], ["y"], name="D"),
    ]
    model = ir.from_proto(make_model(nodes, [vi("x", ["N", 4])], [vi("y", ["N", 4])], [
        h.make_tensor("reps", 7, [2], [1, 8]), h.make_tensor("axes", 7, [1], [1])]))
    model.metadata_props.update({md.MODEL_GRADIENTS: "[]", md.MODEL_STATE_PAIRS: "[]"})
    report = estimate_memory(model, batch=2)
    # ORT order A, C, R, B, D: the peak is at C (a and c: 2 * 4 * 2 * 32 bytes), b is made later.
    assert [n.name for n in ort_order(model)] == ["A", "C", "R", "B", "D"]
    assert report.transient_peak_bytes == 2 * 4 * 2 * 32
    assert report.transient_peak_node == "Relu 'C'"


def test_pattern_block_packs_like_ort_mem_pattern_planner():
    """a (128 B) at offset 0, b (64 B) at 128; a is freed; c (192 B) does not fit the 128-byte gap
    below b, so ORT puts it after b: the block is 384 bytes while at most 256 are alive."""
    buffers = [_Buffer("a", 0, 1, 128), _Buffer("b", 1, 3, 64), _Buffer("c", 2, 3, 192)]
    assert _pattern_block(buffers) == 128 + 64 + 192
    # A later buffer that fits the gap takes the smallest one that fits (best fit), not the end.
    buffers.append(_Buffer("d", 4, 5, 100))  # after everything is freed: offset 0
    assert _pattern_block(buffers) == 384
    assert _pattern_block([_Buffer("e", 0, 0, 1)]) == PATTERN_ALIGNMENT


def test_the_arena_grows_past_the_peak_when_a_freed_chunk_is_too_small():
    """a (256 B) gets region 1, b (512 B) region 2; a is freed, but c (512 B) does not fit its
    256-byte chunk, so the arena grows a third region: 1280 bytes for a peak of 1024. Later
    requests take the smallest free chunk that fits, split when it is twice the request."""
    buffers = [_Buffer("a", 0, 1, 256), _Buffer("b", 1, 3, 512), _Buffer("c", 2, 3, 512)]
    assert _arena_bytes(buffers) == 256 + 512 + 512
    # Then all is free: d (200 -> 256 B) takes a's chunk exactly; e (256 B) the first 512-byte
    # chunk, split in two; f (1000 -> 1024 B) fits no free chunk (256, 512: regions stay apart).
    buffers += [_Buffer("d", 4, 6, 200), _Buffer("e", 5, 6, 256), _Buffer("f", 5, 6, 1000)]
    assert _arena_bytes(buffers) == 256 + 512 + 512 + 1024
    assert _arena_bytes([_Buffer("g", 0, 0, 1)]) == ARENA_UNIT


def test_estimated_peak_holds_the_pattern_block_beside_the_first_step():
    nodes = [h.make_node("Relu", ["x"], ["a"], name="r1"), h.make_node("Relu", ["a"], ["y"], name="r2")]
    report = estimate_memory(_step(nodes, [vi("x", ["N", 8])], [vi("y", ["N", 8])]), batch=16)
    assert report.transient_peak_bytes == report.pattern_block_bytes == report.first_step_arena_bytes == 4 * 16 * 8
    assert report.estimated_peak_bytes == (report.persistent_bytes + report.output_bytes
                                           + report.first_step_arena_bytes + report.pattern_block_bytes)
    assert report.peak_without_pattern_bytes == report.estimated_peak_bytes - report.pattern_block_bytes


def test_a_transpose_read_only_by_matmuls_is_folded_away():
    """The exported Linear: MatMul(x, Transpose(W)). ORT folds the Transpose into the MatMul
    (MatmulTransposeFusion), so no transposed copy of W exists; a Transpose read by anything
    else (here a Relu) keeps its own buffer."""
    nodes = [
        h.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
        h.make_node("MatMul", ["x", "wt"], ["a"], name="mm"),
        h.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    inputs = [vi("x", ["N", 8]), vi("w", [4, 8])]
    folded = estimate_memory(_step(nodes, inputs, [vi("y", ["N", 4])]), batch=16)
    assert folded.transient_peak_bytes == 4 * 16 * 4  # a alone
    also_relu = [*nodes, h.make_node("Relu", ["wt"], ["z"], name="other")]
    kept = estimate_memory(_step(also_relu, inputs, [vi("y", ["N", 4]), vi("z", [8, 4])]), batch=16)
    assert kept.transient_peak_bytes == folded.transient_peak_bytes + 4 * 8 * 4  # plus wt


def test_a_transpose_of_a_transpose_reads_the_original():
    """x -> Transpose t1 -> MatMul (forward), and later Transpose(t1) -> Relu (backward-like). ORT
    composes the two transposes into one transpose of x, so t1 dies after the MatMul: at the
    second transpose only x (an input) and the new buffer are alive, not t1."""
    nodes = [
        h.make_node("Transpose", ["x"], ["t1"], name="t1", perm=[1, 0]),
        h.make_node("MatMul", ["t1", "w"], ["a"], name="mm"),
        h.make_node("Transpose", ["t1"], ["t2"], name="t2", perm=[1, 0]),
        h.make_node("Relu", ["t2"], ["z"], name="relu2"),
        h.make_node("Relu", ["a"], ["y"], name="relu"),  # the last leaf: its chain runs first
    ]
    model = _step(nodes, [vi("x", [8, "N"]), vi("w", [8, 4])], [vi("y", ["N", 4]), vi("z", [8, "N"])])
    report = estimate_memory(model, batch=16)
    # ORT order: t1, mm, relu, then t2 (z's chain). t1 (512 B) and a (256 B) are alive at mm; t2
    # (512 B) alone at relu2, as t1 died after the MatMul. Read by t2, t1 would be alive beside
    # t2: 1024 bytes.
    assert [n.name for n in ort_order(model)] == ["t1", "mm", "relu", "t2", "relu2"]
    assert report.transient_peak_bytes == 4 * 8 * 16 + 4 * 16 * 4


def test_arena_log_splits_a_capturing_call_by_the_runs_ort_makes_inside_it():
    """``MPGRAPH_ORT_LOG_SEVERITY=1``: ORT's "Start another run" lines (it runs a step twice
    uncaptured, then captures it, inside one call) start phases of their own, a run that grew
    nothing included, so ``trainer_memory.py`` can say which run grew the arena."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from memory_check import MARK, parse_arena_log

    another = "I [inference_session.cc:3560] Start another run for necessary memory allocation or graph capture."
    log = "\n".join([
        f"{MARK} model:step1",
        "I Extending BFCArena for Cuda. bin_num:5 (requested) num_bytes: 9437184 (actual) rounded_bytes:9437184",
        "I Extended allocation by 9437184 bytes.",
        another,
        "I Extending BFCArena for Cuda. bin_num:2 (requested) num_bytes: 4096 (actual) rounded_bytes:4096",
        "I Extended allocation by 4096 bytes.",
        another,
        f"{MARK} model:step2",
        "I Extending BFCArena for Cuda. bin_num:1 (requested) num_bytes: 512 (actual) rounded_bytes:512",
        "I Extended allocation by 512 bytes.",
        "I Extending BFCArena for Cuda. bin_num:0 (requested) num_bytes: 64 (actual) rounded_bytes:256",
        "I Extended allocation by 1073741824 bytes.",  # a power-of-two arena's next region
    ])
    phases = parse_arena_log(log)
    assert list(phases) == ["model:step1", "model:step1:run2", "model:step1:run3", "model:step2"]
    assert phases["model:step1"]["Cuda"]["extended"] == 9437184 and phases["model:step1:run2"]["Cuda"]["extended"] == 4096
    assert phases["model:step1:run3"] == {} and phases["model:step2"]["Cuda"]["extended"] == 512 + 2**30
    assert phases["model:step2"]["Cuda"]["largest"] == 512 and phases["model:step2"]["Cuda"]["largest_extension"] == 2**30


def test_session_log_severity_comes_from_the_environment(monkeypatch):
    import pytest

    from mpgraph.errors import UsageError
    from mpgraph.runtime.providers import session_log_severity

    monkeypatch.delenv("MPGRAPH_ORT_LOG_SEVERITY", raising=False)
    assert session_log_severity() == 4
    monkeypatch.setenv("MPGRAPH_ORT_LOG_SEVERITY", "1")
    assert session_log_severity() == 1
    monkeypatch.setenv("MPGRAPH_ORT_LOG_SEVERITY", "info")
    with pytest.raises(UsageError, match="0 \\(verbose\\) to 4"):
        session_log_severity()


def test_each_session_writes_the_graph_ort_optimized_where_asked(tmp_path, monkeypatch):
    """``MPGRAPH_ORT_OPTIMIZED_MODELS``: every session mpgraph makes writes the graph ORT runs
    after its own optimizations, a file each, so a GPU run can bring back what ORT allocated for."""
    import onnx
    from onnx import TensorProto

    from mpgraph.runtime.providers import new_session

    folder = tmp_path / "opt"
    monkeypatch.setenv("MPGRAPH_ORT_OPTIMIZED_MODELS", str(folder))
    graph = h.make_graph([h.make_node("Add", ["x", "x"], ["y"]), h.make_node("Relu", ["y"], ["z"])], "g",
                         [h.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                         [h.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9).SerializeToString()
    for _ in range(2):
        new_session(model, "cpu", {}, threads=1)
    assert sorted(p.name for p in folder.iterdir()) == ["cpu-0.onnx", "cpu-1.onnx"]
    assert [n.op_type for n in onnx.load(str(folder / "cpu-1.onnx")).graph.node] == ["Add", "Relu"]
    monkeypatch.delenv("MPGRAPH_ORT_OPTIMIZED_MODELS")
    new_session(model, "cpu", {}, threads=1)
    assert len(list(folder.iterdir())) == 2


def test_device_values_grow_their_arena_as_requested_once_per_process(monkeypatch):
    """``exact_device_values`` sets onnxruntime-gpu's process-wide growth of the arena Python-made
    device values live in to kSameAsRequested, once, with ORT's deprecation warning silenced and
    the default logger put back where mpgraph last set it; without that setter (a CPU build) it
    changes nothing. The CUDA half runs against a stand-in for the GPU build's two names."""
    import enum
    import types

    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as C

    from mpgraph.runtime import providers

    monkeypatch.setattr(providers, "_exact_device_values", None)
    monkeypatch.setattr(providers, "_logger_severity", 2)
    if not hasattr(C, "set_arena_extend_strategy"):  # this build: nothing to set
        assert providers.exact_device_values() is False and providers.exact_device_values() is False
        monkeypatch.setattr(providers, "_exact_device_values", None)

    class Strategy(enum.Enum):
        kNextPowerOfTwo = 0
        kSameAsRequested = 1

    calls, levels = [], []
    fake = types.SimpleNamespace(set_arena_extend_strategy=lambda s: calls.append((s, levels[-1])),
                                 ArenaExtendStrategy=Strategy)
    monkeypatch.setattr(ort.capi, "_pybind_state", fake)
    monkeypatch.setattr(ort, "set_default_logger_severity", levels.append)
    providers.set_default_logger_severity(1)  # a script asking for the arenas' INFO log
    assert providers.exact_device_values() is True
    assert calls == [(Strategy.kSameAsRequested, 3)]  # set while warnings were silenced
    assert levels == [1, 3, 1]  # ... and the script's level put back
    assert providers.exact_device_values() is True and len(calls) == 1  # once per process


def test_state_values_are_reserved_as_one_region_where_the_arena_is_exact(monkeypatch):
    """``reserve_device_values`` makes and frees one CUDA buffer of the values' sizes as the arena
    rounds them (256 bytes) plus the slack, only where ``exact_device_values`` holds (a CPU build:
    nothing). The CUDA half runs against a stand-in for the GPU build's OrtValue."""
    import onnxruntime as ort

    from mpgraph.runtime import providers

    monkeypatch.setattr(providers, "exact_device_values", lambda: False)
    assert providers.reserve_device_values([1000, 4]) == 0
    made = []
    monkeypatch.setattr(providers, "exact_device_values", lambda: True)
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type",
                        staticmethod(lambda shape, dtype, device, index: made.append((shape, dtype, device, index))))
    total = 1024 + 256 + 256 + providers.RESERVE_SLACK
    assert providers.reserve_device_values([1000, 4, 0], device_id=1) == total
    assert made == [([total], np.uint8, "cuda", 1)]
    assert providers.reserve_device_values([]) == 0 and len(made) == 1


def test_arena_instances_are_told_apart_by_their_running_totals():
    """Every CUDA arena in ORT's log is called "Cuda"; ``arena_instances`` follows each by its
    "Total allocated bytes": the 1 GiB region a power-of-two value arena adds for a 64-byte
    request lands on that arena, not on the session's, which grew the same phase."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from memory_check import MARK, arena_instances

    def grow(arena: str, request: int, by: int, total: int) -> list[str]:
        return [f"I Extending BFCArena for {arena}. bin_num:0 (requested) num_bytes: {request} (actual)",
                f"I Extended allocation by {by} bytes.", f"I Total allocated bytes: {total}"]

    creating = "I Creating BFCArena for Cuda with following configs: initial_chunk_size_bytes: 1048576 arena_extend_strategy: 0"
    log = "\n".join([
        f"{MARK} model:init", creating,  # the value arena: the state, in doubling regions
        *grow("Cuda", 1 << 20, 1 << 20, 1 << 20), *grow("Cuda", 3 << 20, 4 << 20, 5 << 20),
        f"{MARK} model:step1", creating,  # the capturing session's arena
        *grow("Cuda", 9 << 20, 9 << 20, 9 << 20),
        *grow("Cuda", 64, 1 << 30, (5 << 20) + (1 << 30)),  # the value arena again
        *grow("Cuda", 2 << 20, 2 << 20, 11 << 20),
    ])
    phases = arena_instances(log)
    assert {i: (r["extended"], r["count"]) for i, r in phases["model:init"].items()} == {1: (5 << 20, 2)}
    step1 = {i: (r["extended"], r["count"], r["total"]) for i, r in phases["model:step1"].items()}
    assert step1 == {1: (1 << 30, 1, (5 << 20) + (1 << 30)), 2: (11 << 20, 2, 11 << 20)}
