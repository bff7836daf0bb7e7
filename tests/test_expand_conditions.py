"""ExpandWhereConditionsPass: full-size Where conditions, once per condition, same values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mpgraph.training.expand_conditions import ExpandWhereConditionsPass


def _model(cond_shape: list[int], x_shape: list[object], fill_shape: list[int], layers: int = 2) -> ir.Model:
    """``layers`` masked fills sharing one condition, chained: ``y_i = Where(c, fill, y_{i-1}) * 2``."""
    nodes, prev = [], "x"
    for i in range(layers):
        nodes.append(helper.make_node("Where", ["c", "fill", prev], [f"w{i}"], name=f"where{i}"))
        nodes.append(helper.make_node("Mul", [f"w{i}", "two"], [f"y{i}"], name=f"mul{i}"))
        prev = f"y{i}"
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, cond_shape),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)],
        [helper.make_tensor("fill", TensorProto.FLOAT, fill_shape, [-1e4] * int(np.prod(fill_shape))),
         helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_causal_mask_expanded_once_same_values() -> None:
    model = _model([4, 4], ["batch", 3, 4, 4], [])
    rng = np.random.default_rng(0)
    feeds = {"c": np.triu(np.ones((4, 4), bool), 1), "x": rng.standard_normal((2, 3, 4, 4)).astype(np.float32)}
    before = _run(model, feeds)
    assert ExpandWhereConditionsPass()(model).modified
    ops = [n.op_type for n in model.graph]
    # One Shape + Expand before the first Where; both Wheres read the expanded condition.
    assert ops == ["Shape", "Expand", "Where", "Mul", "Where", "Mul"], ops
    wheres = [n for n in model.graph if n.op_type == "Where"]
    assert wheres[0].inputs[0] is wheres[1].inputs[0]
    assert wheres[0].inputs[0].producer().op_type == "Expand"
    np.testing.assert_array_equal(_run(model, feeds), before)


@pytest.mark.parametrize(
    ("cond_shape", "x_shape", "fill_shape"),
    [
        ([1], ["batch", 3, 4, 4], []),          # scalar condition: ORT's simple kernel already
        (["batch", 3, 4, 4], ["batch", 3, 4, 4], []),  # already full
        ([4, 4], ["batch", 3, 4, 4], [4, 1]),   # the fill broadcasts too: expanding c alone won't help
    ],
)
def test_left_alone(cond_shape: list[object], x_shape: list[object], fill_shape: list[int]) -> None:
    model = _model(cond_shape, x_shape, fill_shape)
    assert not ExpandWhereConditionsPass()(model).modified
    assert [n.op_type for n in model.graph].count("Expand") == 0


def _per_layer_masks(second_flips: bool) -> ir.Model:
    """Two masked fills, each with its own ``Not`` of the graph input ``c`` (as each exported
    decoder layer slices its own mask); with ``second_flips`` the second mask is ``c`` itself."""
    second = "c" if second_flips else "m1"
    nodes = [
        helper.make_node("Not", ["c"], ["m0"], name="not0"),
        helper.make_node("Where", ["m0", "fill", "x"], ["w0"], name="where0"),
        *([] if second_flips else [helper.make_node("Not", ["c"], ["m1"], name="not1")]),
        helper.make_node("Where", [second, "fill", "w0"], ["w1"], name="where1"),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [4, 4]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("w1", TensorProto.FLOAT, None)],
        [helper.make_tensor("fill", TensorProto.FLOAT, [], [-1e4])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


@pytest.mark.parametrize("second_flips", [False, True])
def test_conditions_computed_alike_share_one_expand(second_flips: bool) -> None:
    model = _per_layer_masks(second_flips)
    rng = np.random.default_rng(0)
    feeds = {"c": np.triu(np.ones((4, 4), bool), 1), "x": rng.standard_normal((2, 3, 4, 4)).astype(np.float32)}
    before = _run(model, feeds)
    ExpandWhereConditionsPass()(model)
    ops = [n.op_type for n in model.graph]
    if second_flips:  # c and Not(c) differ: two Expands, both Nots' readers kept
        assert ops.count("Expand") == 2, ops
    else:  # Not(c) twice: one Expand, and the second Not, now unread, is gone
        assert ops == ["Not", "Shape", "Expand", "Where", "Where"], ops
    np.testing.assert_array_equal(_run(model, feeds), before)
