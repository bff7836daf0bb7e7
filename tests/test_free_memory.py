"""Freeing memory early in a lowered plan: the loss head's gradient written over the logits
(``audit.buffer_reuse``, the library's ``MayInplace``) and weight gradients listed as soon as
they can run (``lowering.free_early``)."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph.audit import memory
from mpgraph.audit.buffer_reuse import MAY_INPLACE, share_input_buffers
from mpgraph.lowering.build import build_library
from mpgraph.lowering.free_early import free_early
from tests.helpers import make_model, run, vi

ROWS, COLS = 4, 8


def _head(read_after: bool):
    """logits = x + x; (loss, stats, count) = Rows(logits, y); d = RowsGrad(logits, ...);
    ``read_after``: a node reads the logits and the gradient (so runs after it)."""
    nodes = [h.make_node("Add", ["x", "x"], ["logits"]),
             h.make_node("SoftmaxCrossEntropyRows", ["logits", "y"], ["loss", "stats", "count"], domain="ai.mpgraph"),
             h.make_node("SoftmaxCrossEntropyRowsGrad", ["logits", "y", "stats", "count", "dloss"], ["d"],
                         domain="ai.mpgraph"),
             h.make_node("Mul", ["d", "d"], ["out"])]
    outputs = [vi("out", [ROWS, COLS]), vi("loss", [])]
    if read_after:
        nodes.append(h.make_node("Mul", ["logits", "d"], ["late"]))
        outputs.append(vi("late", [ROWS, COLS]))
    model = make_model(nodes, [vi("x", [ROWS, COLS]), vi("y", [ROWS], T.INT64), vi("dloss", [])], outputs)
    model.opset_import.append(h.make_opsetid("ai.mpgraph", 1))
    model.graph.value_info.extend([vi(n, [ROWS, COLS]) for n in ("logits", "d")] + [vi("stats", [ROWS, 2]), vi("count", [])])
    return ir.from_proto(model)


def _owners(model: ir.Model) -> dict[str, str]:
    nodes = memory.ort_order(model)
    return share_input_buffers(nodes, memory._buffers(nodes), memory._reads, {v.name for v in model.graph.outputs})


def test_gradient_takes_the_logits_buffer_when_they_die_there():
    assert _owners(_head(read_after=False))["d"] == "logits"


def test_gradient_keeps_its_own_buffer_when_the_logits_are_read_later():
    assert _owners(_head(read_after=True))["d"] == "d"


def test_library_declares_what_the_estimate_mirrors():
    """The built library's ``GetMayInplace`` pairs are ``MAY_INPLACE``'s (and no other op has any)."""
    lib = ctypes.CDLL(str(build_library(cuda=False)))
    pairs = (ctypes.c_int * 8)()
    for name in ("SoftmaxCrossEntropyRowsGrad", "SoftmaxCrossEntropyRows", "AdamWUpdate", "Pointwise"):
        n = lib.MpgraphKernelsMayInplace(name.encode(), pairs, 4)
        assert tuple((pairs[2 * k], pairs[2 * k + 1]) for k in range(n)) == MAY_INPLACE.get(("ai.mpgraph", name), ())


def _weight_gradient_graph(big=(64, 64)):
    """A chain a -> b -> c of [64, 64] values and a small 'dW' = ReduceSum(a * b) that only the
    last node reads: ORT's own order runs it last, with a and b live until then."""
    big = list(big)
    nodes = [h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["a"], ["b"]),
             h.make_node("Mul", ["a", "b"], ["ab"]), h.make_node("ReduceSum", ["ab"], ["dw"], keepdims=0),
             h.make_node("Exp", ["b"], ["c"]), h.make_node("Sigmoid", ["c"], ["e"]),
             h.make_node("Tanh", ["e"], ["f"]), h.make_node("Add", ["f", "dw"], ["out"])]
    model = make_model(nodes, [vi("x", big)], [vi("out", big)])
    model.graph.value_info.extend([vi(n, big) for n in "abcef"] + [vi("ab", big), vi("dw", [])])
    return model


def test_free_early_leaves_a_graph_of_unknown_sizes_as_it_is():
    """Nothing to gain that it can see (every size unknown): the list stays, as ORT's own walk
    over a new list could run later what ran early."""
    model = ir.from_proto(_weight_gradient_graph(("N", 64)))
    before = list(model.graph)
    assert free_early(model) == 0 and list(model.graph) == before


def _peak(model: ir.Model) -> int:
    nodes = memory.ort_order(model)
    buffers, *_ = memory._walk(nodes, memory._recorded(model), {v.name for v in model.graph.outputs})
    return memory._peak(buffers, nodes)[0]


def test_free_early_runs_the_weight_gradient_before_the_rest_of_the_chain():
    proto = _weight_gradient_graph()
    model = ir.from_proto(proto)
    before = [n.op_type for n in memory.ort_order(model)]
    peak = _peak(model)
    assert before.index("ReduceSum") > before.index("Tanh")  # ORT's own order: dW last
    assert free_early(model) > 0
    after = [n.op_type for n in memory.ort_order(model)]
    assert after.index("ReduceSum") < after.index("Exp")
    assert _peak(model) < peak
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    np.testing.assert_array_equal(run(ir.to_proto(model), {"x": x})[0], run(proto, {"x": x})[0])


def _ort_ran(proto, tmp_path, name: str = "x", shape: tuple[int, ...] = (64, 64)) -> list[str]:
    """The op types in the order ORT CPU ran them (its profile), default graph optimizations."""
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix, options.log_severity_level = True, str(tmp_path / "p"), 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, {name: np.ones(shape, np.float32)})
    with open(session.end_profiling()) as f:
        events = json.load(f)
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def test_ort_runs_the_order_free_early_lists(tmp_path):
    """ORT itself (CPU; the order is the provider-independent GraphViewer's) runs the modelled
    order: the weight gradient last as the graph comes, right after its inputs once listed anew."""
    proto = _weight_gradient_graph()
    for k, node in enumerate(proto.graph.node):
        node.name = f"n{k}"
    model = ir.from_proto(proto)
    assert _ort_ran(proto, tmp_path) == [n.op_type for n in memory.ort_order(model)]
    free_early(model)
    ran = _ort_ran(ir.to_proto(model), tmp_path)
    assert ran == [n.op_type for n in memory.ort_order(model)] and ran.index("ReduceSum") < ran.index("Exp")


def test_gradient_over_its_logits_gives_the_same_bits_on_cpu():
    """The CPU kernels with logits = Neg(x), which die at the gradient (ORT may write it over
    them), and with the same logits fed as a graph input (which it may not): the same bits."""
    from tests.helpers import run_named

    attrs = {"valid_cols": 13, "ignore_index": -100, "reduction": 0}
    rows_ops = [h.make_node("SoftmaxCrossEntropyRows", ["logits", "y"], ["loss", "stats", "count"], domain="ai.mpgraph", **attrs),
                h.make_node("SoftmaxCrossEntropyRowsGrad", ["logits", "y", "stats", "count", "dloss"], ["d"],
                            domain="ai.mpgraph", **attrs)]
    outputs = [vi("loss", None), vi("d", [6, 16])]
    models = []
    for name, nodes in (("x", [h.make_node("Neg", ["x"], ["logits"])]), ("logits", [])):
        model = make_model(nodes + rows_ops, [vi(name, [6, 16]), vi("y", [6], T.INT64), vi("dloss", [])], outputs)
        model.opset_import.append(h.make_opsetid("ai.mpgraph", 1))
        models.append(ir.from_proto(model))
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 16)) * 3).astype(np.float32)
    y, dloss = np.array([0, 12, -100, 5, 3, 1], np.int64), np.array(2.0, np.float32)
    fused = run_named(models[0], {"x": x, "y": y, "dloss": dloss}, library=True)
    fed = run_named(models[1], {"logits": -x, "y": y, "dloss": dloss}, library=True)
    np.testing.assert_array_equal(fused["d"], fed["d"])
    assert np.any(fused["d"] != 0) and np.all(fused["d"][:, 13:] == 0)


def _late_reduction_graph():
    """d = x * x, read by a small ReduceSum r (a bias gradient) and by a chain e = -d, f = |e|,
    s = sin(f); small reductions of e and f go with r into one Concat (the optimizer's of the
    small gradients), s's ReduceMax g beside it. ORT's walk reaches r through that Concat after
    the chain's other reductions, so d stays live through the chain."""
    n = 4096
    nodes = [h.make_node("Mul", ["x", "x"], ["d"]), h.make_node("ReduceSum", ["d"], ["r"], keepdims=1),
             h.make_node("Neg", ["d"], ["e"]), h.make_node("ReduceMin", ["e"], ["q1"], keepdims=1),
             h.make_node("Abs", ["e"], ["f"]), h.make_node("ReduceL1", ["f"], ["q2"], keepdims=1),
             h.make_node("Sin", ["f"], ["s"]), h.make_node("ReduceMax", ["s"], ["g"], keepdims=1),
             h.make_node("Concat", ["r", "q1", "q2"], ["c"], axis=0), h.make_node("Concat", ["c", "g"], ["out"], axis=0)]
    for k, node in enumerate(nodes):
        node.name = f"n{k}"
    proto = make_model(nodes, [vi("x", [n])], [vi("out", [4])])
    proto.graph.value_info.extend([vi(v, [n]) for v in "defs"] + [vi(v, [1]) for v in ("r", "q1", "q2", "g")]
                                  + [vi("c", [3])])
    return proto


def test_free_early_runs_a_small_last_reader_of_a_large_buffer_right_after_it(tmp_path):
    """Case 5: without it r runs after the chain (the listing alone leaves it there); with it r
    and its Concat are listed right before their readers, so ORT's walk (and ORT CPU itself, by
    its profile) runs r right after d, which then dies at e: a lower peak, the same bits."""
    proto = _late_reduction_graph()
    model = ir.from_proto(proto)
    assert [n.op_type for n in memory.ort_order(model)] == _ort_ran(proto, tmp_path, "x", (4096,))
    assert [n.op_type for n in memory.ort_order(model)].index("ReduceSum") > 2
    peak = _peak(model)
    assert free_early(model) >= 1
    ran = _ort_ran(ir.to_proto(model), tmp_path, "x", (4096,))
    assert ran == [n.op_type for n in memory.ort_order(model)] and ran[:2] == ["Mul", "ReduceSum"]
    assert _peak(model) < peak
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    np.testing.assert_array_equal(run(ir.to_proto(model), {"x": x})[0], run(proto, {"x": x})[0])
