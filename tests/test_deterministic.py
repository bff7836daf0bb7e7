"""``Trainer(deterministic=True)``: the embedding gradient's scatter-add as a one-hot Gemm
(``mpgraph.lowering.deterministic``), equal to the scatter; on CUDA, two runs give the same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mpgraph.lowering.deterministic import one_hot_scatter, ones_matmul_sums
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.helpers import random_batches

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "models/onnx/gpt.loss.onnx"
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def _scatter_model(zeros: bool, reduction: str = "add", index_width: int = 1) -> onnx.ModelProto:
    """ScatterND of updates [2, 5, 3] at indices [2, 5, width] into a [7, 3] tensor."""
    nodes = []
    inputs = [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 5, index_width]),
              helper.make_tensor_value_info("upd", TensorProto.FLOAT, [2, 5, 3])]
    if zeros:
        shape = helper.make_tensor("shape", TensorProto.INT64, [2], [7, 3])
        nodes.append(helper.make_node("ConstantOfShape", ["shape"], ["data"],
                                      value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])))
        inits = [shape]
    else:
        inputs.append(helper.make_tensor_value_info("data", TensorProto.FLOAT, [7, 3]))
        inits = []
    nodes.append(helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], name="grad/emb/ScatterND",
                                  reduction=reduction))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [7, 3])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("zeros", [True, False])
def test_one_hot_gemm_equals_the_scatter_add(zeros: bool):
    rng = np.random.default_rng(0)
    feeds = {"idx": rng.integers(-7, 7, (2, 5, 1)).astype(np.int64),  # repeats and negative indices
             "upd": rng.integers(-8, 8, (2, 5, 3)).astype(np.float32)}  # small integers: sums exact in any order
    if not zeros:
        feeds["data"] = rng.integers(-8, 8, (7, 3)).astype(np.float32)
    proto = _scatter_model(zeros)
    model = ir.from_proto(proto)
    assert one_hot_scatter(model) == 1
    rewritten = ir.to_proto(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ScatterND" not in ops and "OneHot" in ops and "Gemm" in ops and ("Add" in ops) != zeros
    np.testing.assert_array_equal(_run(rewritten, feeds), _run(proto, feeds))


@pytest.mark.parametrize("reduction, width", [("none", 1), ("add", 2)])
def test_other_scatters_are_left_alone(reduction: str, width: int):
    model = ir.from_proto(_scatter_model(True, reduction, width))
    assert one_hot_scatter(model) == 0
    assert [n.op_type for n in model.graph] == ["ConstantOfShape", "ScatterND"]


def _sum_model(shape: list, axes: list | None, keepdims: int | None = 0, dtype: int = TensorProto.FLOAT,
               noop: int | None = None) -> onnx.ModelProto:
    """One ``ReduceSum`` of x (``shape``; a str is a symbolic dim) over constant ``axes``
    (``keepdims=None``: no attribute, ONNX's default of 1)."""
    inits, names = [], ["x"]
    if axes is not None:
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes))
        names.append("axes")
    attrs = ({"keepdims": keepdims} if keepdims is not None else {}) | (
        {"noop_with_empty_axes": noop} if noop is not None else {})
    node = helper.make_node("ReduceSum", names, ["y"], name="grad/fc/bias_sum", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", dtype, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("shape, axes, keepdims", [
    (["B", "T", 6], [0, 1], 0),    # a bias gradient: symbolic batch dims
    ([3, 4, 6], [1, 0], 0),        # the same axes unordered, static
    ([3, 4, 6], [-3, -2], 1),      # negative axes, keepdims
    ([5, 2, 3, 4], [0], 0),        # one axis, several trailing
    ([7], None, 0),                # no axes: a full sum to a scalar (the loss)
    ([3, 4], [0, 1], 1),           # every axis, kept
    (["B", 4, 6], [0, 1], None),   # no keepdims attribute: ONNX's default keeps the axes
])
def test_ones_matmul_equals_the_leading_sum(shape: list, axes: list | None, keepdims: int | None):
    rng = np.random.default_rng(1)
    concrete = [d if isinstance(d, int) else 2 + i for i, d in enumerate(shape)]
    x = rng.integers(-8, 8, concrete).astype(np.float32)  # small integers: exact in any order
    proto = _sum_model(shape, axes, keepdims)
    model = ir.from_proto(proto)
    assert ones_matmul_sums(model) == 1
    rewritten = ir.to_proto(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ReduceSum" not in ops and "MatMul" in ops and ("Unsqueeze" in ops) == (keepdims != 0)
    got, want = _run(rewritten, {"x": x}), _run(proto, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape, axes, dtype, noop", [
    ([3, 4, 6], [2], TensorProto.FLOAT, None),        # a trailing axis (a softmax's row sum)
    ([3, 4, 6], [0, 2], TensorProto.FLOAT, None),     # not a leading block
    ([3, 4, 6], [0, 1], TensorProto.FLOAT16, None),   # float16: cuBLAS could accumulate in it
    ([3, 4], [0], TensorProto.INT64, None),
    ([3, 4], None, TensorProto.FLOAT, 1),             # no axes and noop_with_empty_axes: identity
])
def test_other_sums_are_left_alone(shape: list, axes: list | None, dtype: int, noop: int | None):
    model = ir.from_proto(_sum_model(shape, axes, dtype=dtype, noop=noop))
    assert ones_matmul_sums(model) == 0
    assert [n.op_type for n in model.graph] == ["ReduceSum"]


def test_bfloat16_sums_are_rewritten_with_cast_ones():
    """bfloat16 ones come from float32 ones and a Cast: the graph's opset (18) has no bfloat16
    ``ConstantOfShape``. The model passes the full ONNX checker."""
    proto = _sum_model(["B", 8], [0], dtype=TensorProto.BFLOAT16)
    proto.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [8]))
    model = ir.from_proto(proto)
    assert ones_matmul_sums(model) == 1
    ones = next(n for n in model.graph if n.op_type == "ConstantOfShape")
    assert ones.attributes["value"].as_tensor().dtype == ir.DataType.FLOAT
    cast = next(n for n in model.graph if n.op_type == "Cast")
    assert cast.attributes["to"].as_int() == TensorProto.BFLOAT16 and cast.outputs[0].consumers()[0].op_type == "MatMul"
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_ones_matmul_step_graph_trains_the_zoo_gpt_as_before():
    """The zoo GPT's step graph with every bias gradient as a ones MatMul (what a CUDA trainer
    with ``deterministic=True`` runs), on ORT CPU: six steps within float32 rounding. SGD, not
    Adam: the attention's key bias has a gradient that is zero but for rounding (softmax
    ignores a shift of every score), and Adam scales such noise up to full-size steps whose
    signs follow the summation order (1e-3 apart after one step)."""
    step = build_training_graph(GPT, optimizer="sgd")
    rewritten = ir.from_proto(ir.to_proto(step))
    assert ones_matmul_sums(rewritten) >= 10
    assert not any(n.op_type == "ReduceSum" and _leading(n) for n in rewritten.graph)
    _trains_as_before(step, rewritten)


def _trains_as_before(step: ir.Model, rewritten: ir.Model) -> None:
    """Six steps of both graphs on ORT CPU: losses and final state within float32 rounding."""
    plain, other = Trainer(step, threads=1, kernels=False), Trainer(rewritten, threads=1, kernels=False)
    batches = random_batches(plain, 6, 4, seed=1, high=16)
    a = [plain.step(b, 1e-2).loss for b in batches]
    b = [other.step(b, 1e-2).loss for b in batches]
    np.testing.assert_allclose(b, a, rtol=1e-5)
    sa, sb = plain.state, other.state
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-4, atol=1e-6, err_msg=k)


def _leading(node: ir.Node) -> bool:
    axes = node.inputs[1] if len(node.inputs) > 1 else None
    return axes is None or (axes.const_value is not None and 0 in axes.const_value.numpy().tolist())


def test_one_hot_step_graph_trains_the_zoo_gpt_as_before():
    """The zoo GPT's step graph with its embedding gradient as a one-hot Gemm (what a CUDA
    trainer with ``deterministic=True`` runs), on ORT CPU: losses and parameters over six steps
    within float32 rounding of the plain graph's (the sums' order differs)."""
    step = build_training_graph(GPT, optimizer="adamw")
    rewritten = ir.from_proto(ir.to_proto(step))
    assert one_hot_scatter(rewritten) >= 1 and not any(n.op_type == "ScatterND" for n in rewritten.graph)
    _trains_as_before(step, rewritten)


def test_deterministic_on_cpu_sets_the_flag_and_rewrites_nothing():
    step = build_training_graph(GPT, optimizer="adamw")
    det = Trainer(step, threads=1, deterministic=True)
    assert det.session.get_session_options().use_deterministic_compute
    assert det.deterministic_rewrites == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDAExecutionProvider")
def test_two_deterministic_cuda_runs_are_the_same_bits():
    step = build_training_graph(GPT, optimizer="adamw", target="cuda")
    runs = [Trainer(step, "cuda", deterministic=True, pipeline=False) for _ in range(2)]
    assert runs[0].deterministic_rewrites >= 1
    batches = random_batches(runs[0], 20, 8, seed=2, high=16)
    losses = [[t.step(b).loss for b in batches] for t in runs]
    assert losses[0] == losses[1]
    s0, s1 = runs[0].state, runs[1].state
    assert all(s0[k].tobytes() == s1[k].tobytes() for k in s0)
