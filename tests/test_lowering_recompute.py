"""``recompute``: the backward recomputes a forward SwiGlu's outputs (y, s) from a and b.

On the Llama MLP sub-layer of ``benchmarks/llama_ab.py`` (float32, ORT CPU with the library's
loops): the step gives the same bits as without the rule, and y and s are no longer live from
the forward to the backward in the memory estimate's order.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.audit import memory
from mpgraph.lowering.recompute import recompute_gelu, recompute_swiglu
from mpgraph.lowering.rmsnorm import fuse_rmsnorm_grad
from mpgraph.lowering.specialize import specialize_shapes
from mpgraph.lowering.swiglu import fuse_swiglu, fuse_swiglu_grad
from tests.helpers import load_benchmark, run_named
from tests.test_lowering_blocks import _copy

SHAPE = (2, 8, 32, 48)  # batch, seq, hidden, intermediate
ab = load_benchmark("llama_ab")


@pytest.fixture(scope="module")
def fused() -> ir.Model:
    """The sub-layer's step with its SwiGLU forward and backward fused (what ``recompute`` sees)."""
    step = ab.block_step(SHAPE, low=False)
    assert fuse_rmsnorm_grad(step) == fuse_swiglu_grad(step) == fuse_swiglu(step) == 1
    return step


def _swiglus(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "SwiGlu"]


def _after_ort(model: ir.Model, tmp_path, library: bool = False) -> Counter:
    """The op types of ``model`` after ORT CPU's own graph optimizations (all levels)."""
    import onnxruntime as ort

    from mpgraph import lowering

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    if library:
        options.register_custom_ops_library(str(lowering.library("cpu")))
    ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


def _outliving(model: ir.Model, names: set[str]) -> int:
    """Bytes of the buffers ``names`` that the estimate's order keeps past the forward's last node."""
    nodes = memory.ort_order(model)
    buffers, *_ = memory._walk(nodes, memory._recorded(model), {v.name for v in model.graph.outputs})
    last_forward = max(i for i, n in enumerate(nodes) if n.metadata_props.get(NODE_ROLE) == Role.FORWARD)
    return sum(b.nbytes for b in buffers if b.name in names and b.end > last_forward)


def test_backward_reads_its_own_swiglu_and_the_step_keeps_its_bits(fused, tmp_path):
    """One backward SwiGlu reading the forward's a and b; the forward's outputs have no backward
    reader left (s none at all); every output of the step is the same bits; again: nothing."""
    lowered = _copy(fused)
    assert recompute_swiglu(lowered) == 1
    forward, backward = sorted(_swiglus(lowered), key=lambda n: n.name.endswith("/recompute"))
    assert backward.metadata_props[NODE_ROLE] == Role.BACKWARD and list(backward.inputs) == list(forward.inputs)
    assert not list(forward.outputs[1].uses())
    assert {u.node.metadata_props.get(NODE_ROLE) for u in forward.outputs[0].uses()} == {Role.FORWARD}
    assert {u.node.op_type for u in backward.outputs[1].uses()} == {"SwiGluGrad"}
    feeds = ab.block_feeds(SHAPE)
    want, got = run_named(fused, feeds, library=True), run_named(lowered, feeds, library=True)
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert recompute_swiglu(lowered) == 0
    assert _after_ort(lowered, tmp_path, library=True)["SwiGlu"] == 2  # a custom op: ORT's CSE leaves it


def test_swiglu_outputs_no_longer_outlive_the_forward(fused):
    """Without the rule y and s (2 x 2*8*48 float32) are live into the backward; with it neither."""
    lowered = _copy(fused)
    recompute_swiglu(lowered)
    (node,) = _swiglus(fused)
    names = {v.name for v in node.outputs}
    assert _outliving(fused, names) == 2 * int(np.prod(SHAPE[:2])) * SHAPE[3] * 4
    assert _outliving(lowered, names) == 0


def test_swiglu_read_as_a_graph_output_is_left_alone(fused):
    """A SwiGlu whose y is a graph output keeps its buffer to the end anyway: left as it is."""
    lowered = _copy(fused)
    (node,) = _swiglus(lowered)
    lowered.graph.outputs.append(node.outputs[0])
    assert recompute_swiglu(lowered) == 0


def _gelu_mlp() -> ir.Model:
    """``loss = sum(Gelu(x W1) W2 * c)``, x of shape [2, 8, 16] (3-D: W2's gradient reads the
    GELU's output through a Flatten, as BERT's does), float32, W1 and W2 trained."""
    from onnx import TensorProto as T
    from onnx import helper as h

    from mpgraph.training import build_training_graph

    rng = np.random.default_rng(0)
    nodes = [h.make_node("MatMul", ["x", "w1"], ["a"]), h.make_node("Gelu", ["a"], ["g"]),
             h.make_node("MatMul", ["g", "w2"], ["o"]), h.make_node("Mul", ["o", "c"], ["oc"]),
             h.make_node("ReduceSum", ["oc"], ["loss"], keepdims=0)]
    inits = [h.make_tensor(k, T.FLOAT, list(v.shape), v.ravel().tolist()) for k, v in
             (("w1", rng.standard_normal((16, 32)).astype(np.float32)), ("w2", rng.standard_normal((32, 16)).astype(np.float32)),
              ("c", rng.standard_normal((2, 8, 16)).astype(np.float32)))]
    graph = h.make_graph(nodes, "gelu_mlp", [h.make_tensor_value_info("x", T.FLOAT, [2, 8, 16])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], initializer=inits)
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10))
    step = build_training_graph(model, optimizer=None, params=["w1", "w2"])
    return specialize_shapes(step, {"x": [2, 8, 16]})  # as a session plan does: no Shape(g) left


def test_gelu_is_recomputed_through_the_view_and_ort_keeps_both(tmp_path):
    """W2's gradient reads ``Gelu(Flatten(a))`` made in the backward, not the forward's output;
    the step's outputs are the same bits on ORT CPU; ORT's own optimizations (common
    subexpression elimination among them) leave two Gelus, where a plain second ``Gelu(a)``
    is merged back into the forward's."""
    step = _gelu_mlp()
    lowered = _copy(step)
    assert recompute_gelu(lowered) == 1
    gelus = [n for n in lowered.graph if n.op_type == "Gelu"]
    assert len(gelus) == 2
    forward, backward = sorted(gelus, key=lambda n: n.name.endswith("/recompute"))
    assert {u.node.metadata_props.get(NODE_ROLE) for u in forward.outputs[0].uses()} == {Role.FORWARD}
    assert backward.inputs[0].producer().op_type == "Flatten"
    assert backward.inputs[0].producer().inputs[0] is forward.inputs[0]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)}
    want, got = run_named(step, feeds), run_named(lowered, feeds)
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert recompute_gelu(lowered) == 0

    assert _after_ort(lowered, tmp_path)["Gelu"] == 2
    naive = _copy(step)  # the same copy reading a itself: ORT merges it into the forward's
    (gelu,) = [n for n in naive.graph if n.op_type == "Gelu"]
    twin = ir.Node("", "Gelu", [gelu.inputs[0]], name="twin")
    naive.graph.insert_after(gelu, twin)
    view = next(u.node for u in gelu.outputs[0].uses() if u.node.op_type == "Flatten")
    view.replace_input_with(0, twin.outputs[0])
    assert _after_ort(naive, tmp_path)["Gelu"] == 1


@pytest.mark.parametrize("env", ["", "1"])
def test_the_rule_takes_gelus_only_when_asked(env, monkeypatch):
    """The registered ``recompute`` rule recomputes GELUs only with MPGRAPH_RECOMPUTE_GELU=1
    (untimed on a GPU: GPT-2's tanh GELU passes are 4% of its step); SwiGLUs always."""
    from mpgraph.lowering.registry import RULES, Target

    monkeypatch.setenv("MPGRAPH_RECOMPUTE_GELU", env)
    (rule,) = [r for r in RULES if r.name == "recompute"]
    lowered = _copy(_gelu_mlp())
    assert rule.apply(lowered, Target("cpu", "all")) == (1 if env == "1" else 0)
    assert sum(n.op_type == "Gelu" for n in lowered.graph) == (2 if env == "1" else 1)
