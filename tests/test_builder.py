"""The IR floor: the one node builder, the one name allocator, and the loss-scale role rule."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from mpgraph._ir import meta as md
from mpgraph._ir.builder import Builder, make_cast
from mpgraph._ir.names import NameScope
from mpgraph.autodiff.driver import GradContext
from mpgraph.errors import MpgraphError
from mpgraph.policy import parse_policy


def _graph() -> tuple[ir.Graph, ir.Value]:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    return ir.Graph([x], [], nodes=[], opset_imports={"": 18}), x


def test_names_are_scoped_deterministic_and_unique():
    graph, x = _graph()
    b = Builder(graph, role=md.Role.OPTIMIZER, scope="optim")
    first = [b.op("Relu", x).name, b.op("Relu", x).name, b.op("Relu", x, name="x/relu").name]
    assert first == ["optim/step/Relu", "optim/step/Relu_1", "optim/x/relu"]
    # A second builder over the same graph sees the names already taken.
    again = Builder(graph, role=md.Role.OPTIMIZER, scope="optim")
    assert again.op("Relu", x).name == "optim/step/Relu_2"
    names = [n.name for n in graph] + [v.name for n in graph for v in n.outputs]
    assert len(set(names)) == len(graph)  # a single output carries its node's name


def test_building_the_same_thing_twice_gives_the_same_names():
    def build() -> list[str]:
        graph, x = _graph()
        b = Builder(graph, role=md.Role.BACKWARD, scope="grad")
        parts = b.op_multi("Split", x, b.ints([1, 1]), axis=0, num_outputs=2)
        b.op("Add", *parts)
        return [n.name for n in graph] + [v.name for n in graph for v in n.outputs] + list(graph.initializers)

    assert build() == build()
    assert build()[:4] == ["grad/step/Split", "grad/step/Add", "grad/step/Split:0", "grad/step/Split:1"]


def test_name_scope_suffixes_skip_taken_names():
    graph, _ = _graph()
    names = NameScope(graph)
    assert [names.fresh("x"), names.fresh("a"), names.fresh("a_1"), names.fresh("a")] == ["x_1", "a", "a_1", "a_2"]


def test_every_node_carries_the_role():
    graph, x = _graph()
    Builder(graph, role=md.Role.LOSS, scope="loss").op("Neg", x)
    node = graph.node(0)
    assert dict(node.metadata_props) == {md.NODE_ROLE: "loss"}


def test_grad_context_names_and_tags_the_forward_node():
    graph, x = _graph()
    forward = ir.Node("", "Relu", [x], name="relu1")
    graph.append(forward)
    ctx = GradContext(graph)
    ctx.node = forward
    dy = ctx.op("Mul", x, ctx.scalar(2.0, x))
    assert dy.name == "grad/relu1/Mul"
    assert dict(dy.producer().metadata_props) == {md.NODE_ROLE: "backward", md.NODE_GRAD_OF: "relu1",
                                                  md.NODE_GRAD_OF_VALUE: forward.outputs[0].name}
    ctx.node = None
    assert ctx.op("Neg", x).name == "grad/step/Neg"
    assert isinstance(ctx, Builder)  # optimizers take a Builder, so a GradContext does too


def test_constants_are_deduplicated_by_dtype_shape_and_bytes():
    graph, x = _graph()
    b = Builder(graph, role=md.Role.BACKWARD, scope="grad")
    one = b.scalar(1.0, x)
    assert b.const(np.float32(1.0)) is one
    assert b.const(np.float64(1.0)) is not one
    assert b.const(np.ones((1,), np.float32)) is not one
    assert b.ints([1, 2]) is b.ints((1, 2))
    assert sorted(graph.initializers) == ["grad/const", "grad/const_1", "grad/const_2", "grad/const_3"]
    assert one.dtype == ir.DataType.FLOAT and one.shape == ir.Shape([])


def test_cast_helper_and_dtype_guess():
    graph, x = _graph()
    b = Builder(graph, role=md.Role.OPTIMIZER, scope="optim")
    half = b.cast(x, ir.DataType.FLOAT16)
    assert half.dtype == ir.DataType.FLOAT16
    assert half.producer().attributes["to"].value == ir.DataType.FLOAT16
    assert b.op("IsNaN", half).dtype == ir.DataType.BOOL
    assert b.shape(x).dtype == ir.DataType.INT64


def test_make_cast_is_detached_and_marked():
    _, x = _graph()
    node = make_cast("cast/x_fp16", x, ir.DataType.FLOAT16, "cast", "policy")
    assert node.graph is None and node.outputs[0].name == "cast/x_fp16"
    assert node.metadata_props[md.NODE_INSERTED] == "cast"


# -- the loss-scale role rule ------------------------------------------------------------------


def _step() -> ir.Model:
    from mpgraph.training import build_training_graph

    return build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd")


def _dynamic():
    return parse_policy("extends: fp16\nloss_scaling: {mode: dynamic}\n", "test.yaml").loss_scaling


def test_scaling_records_the_state_by_role_and_runs_once():
    from mpgraph.passes.scale_loss import ScaleLossPass

    step = _step()
    assert ScaleLossPass(_dynamic())(step).modified
    state = json.loads(step.metadata_props[md.MODEL_LOSS_SCALE_STATE])
    assert state == {"found_inf": md.FOUND_INF, "scale": md.LOSS_SCALE, "growth_tracker": md.GROWTH_TRACKER}
    assert not ScaleLossPass(_dynamic())(step).modified  # the metadata says it is scaled already


def test_a_user_input_merely_named_loss_scale_is_an_error_not_a_silent_skip():
    from mpgraph.passes.scale_loss import ScaleLossPass

    step = _step()
    user = ir.Value(name=md.LOSS_SCALE, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    step.graph.inputs.append(user)
    with pytest.raises(MpgraphError, match="'loss_scale'.*not the loss-scale state"):
        ScaleLossPass(_dynamic())(step)


def test_load_checks_the_loss_scale_state_names():
    from mpgraph.errors import ModelLoadError
    from mpgraph.io import check_metadata
    from mpgraph.passes.scale_loss import ScaleLossPass

    step = _step()
    ScaleLossPass(_dynamic())(step)
    check_metadata(ir.to_proto(step))
    step.metadata_props[md.MODEL_LOSS_SCALE_STATE] = json.dumps({"found_inf": "found_inf", "scale": "nowhere"})
    with pytest.raises(ModelLoadError, match="scale 'nowhere', which is not a graph input"):
        check_metadata(ir.to_proto(step))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizers_build_the_same_step_with_a_builder_or_a_grad_context(name):
    from mpgraph.optim import make_optimizer

    def build(make) -> list[tuple[str, str, dict[str, str]]]:
        graph, x = _graph()
        grad = ir.Value(name="grad/x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
        lr = ir.Value(name="lr", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
        graph.inputs.extend([grad, lr])
        b = make(graph)

        def state(state_name: str, like: ir.Value | None, init: float) -> ir.Value:
            value = ir.Value(name=b.unique(state_name), type=ir.TensorType(ir.DataType.FLOAT),
                             shape=ir.Shape([]) if like is None else like.shape)
            graph.inputs.append(value)
            return value

        make_optimizer(name).build(b, [(x, grad)], lr, state)
        return [(n.name, n.op_type, dict(n.metadata_props)) for n in graph]

    plain = build(lambda g: Builder(g, role=md.Role.OPTIMIZER, scope="optim"))
    assert plain == build(lambda g: GradContext(g, role=md.Role.OPTIMIZER, scope="optim"))
    # Adam marks its step counter for loss scaling's skip (mpgraph.on_skip), SGD's has no mark.
    assert plain[0][0].startswith("optim/step/") and plain[0][2][md.NODE_ROLE] == "optimizer"
    assert set(plain[0][2]) <= {md.NODE_ROLE, md.NODE_ON_SKIP}
