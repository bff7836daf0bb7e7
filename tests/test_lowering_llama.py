"""The ``rmsnorm_grad`` and ``swiglu_grad`` rules: Llama's RMSNorm backward as one ``RmsNormGrad``
and its SwiGLU backward (``(a * Sigmoid(a)) * b``, the driver's sum of a's two contributions
included) as one ``SwiGluGrad``, found by the gradient blocks of the canonical forward ops.

On ORT CPU with the library's float32 loops against the unlowered step: ``SwiGluGrad`` computes
the rules' ops in their order, so the gradients that only it feeds (the gate and up weights')
are the same bits; ``RmsNormGrad`` sums in another order (within float32 rounding). Then what
is left alone, the bf16 step's CUDA plan, and (``--runslow``) the tiny HF Llama from both torch
exporters. The CUDA kernels against the unfused ops are ``tests/test_gpu_llama.py``. About 4 CPU-s.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from mpgraph._ir.links import gradient_blocks
from mpgraph._ir.meta import NODE_PRECISION, NODE_ROLE, Role
from mpgraph.lowering import PlanOptions, plan_session
from mpgraph.lowering.rmsnorm import fuse_rmsnorm_grad
from mpgraph.lowering.swiglu import fuse_swiglu, fuse_swiglu_grad
from tests.helpers import load_benchmark, run_named
from tests.test_lowering_blocks import _copy

SHAPE = (2, 8, 32, 48)  # batch, seq, hidden, intermediate
ab = load_benchmark("llama_ab")


def _ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


@pytest.fixture(scope="module")
def step() -> ir.Model:
    """The float32 step graph of one Llama MLP sub-layer (``llama_ab.block``)."""
    return ab.block_step(SHAPE, low=False)


def _both(model: ir.Model) -> tuple[int, int]:
    return fuse_rmsnorm_grad(model), fuse_swiglu_grad(model)


def test_both_backwards_fuse_and_match_the_unlowered_step(step):
    """One RmsNormGradAdd (the norm's backward, its dy's Sum and the residual Sum after it) and
    one SwiGluGrad; the rules' ops go (no ReduceMean, Sqrt,
    Reciprocal, Sub left); the forward stays; the gate and up weight gradients are the same bits, x's and
    gamma's within float32 rounding; lowering again changes nothing."""
    before = _ops(step)
    assert before["ReduceMean"] == 2 and before["Sigmoid"] == 1 and before["Sub"] >= 2
    lowered = _copy(step)
    assert _both(lowered) == (1, 1)
    after = _ops(lowered)
    assert after["RmsNormGradAdd"] == after["SwiGluGrad"] == 1  # dx + the residual's gradient: one Sum fewer
    assert before["Sum"] - after["Sum"] == 3  # n's two parts, a's two contributions, the residual
    assert after["ReduceMean"] == after["Sqrt"] == after["Reciprocal"] == after["Sub"] == 0
    assert after["RMSNormalization"] == after["Sigmoid"] == 1 and after["Mul"] == before["Mul"] - 13  # 7 of the norm rule, 6 of the SwiGLU
    feeds = ab.block_feeds(SHAPE)
    want, got = run_named(step, feeds), run_named(lowered, feeds, library=True)
    for name in ("grad/wg", "grad/wu", "grad/wd"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("grad/x", "grad/gamma", "loss"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-6 * np.abs(want[name]).max(), err_msg=name)
    assert _both(lowered) == (0, 0)


def _swiglu_only(n: int) -> ir.Model:
    """``loss = sum((a * Sigmoid(a)) * b * c)`` with ``a = ain * 1``, ``b = bin * 1`` (the
    ``Mul`` makes a's whole gradient a recorded value, as a gate projection's output has):
    ``grad/ain`` is da and ``grad/bin`` db for dy = c, exactly."""
    from onnx import TensorProto as T
    from onnx import helper as h

    from mpgraph.training import build_training_graph

    nodes = [h.make_node("Mul", ["ain", "one"], ["a"]), h.make_node("Mul", ["bin", "one"], ["b"]),
             h.make_node("Sigmoid", ["a"], ["s"]), h.make_node("Mul", ["a", "s"], ["silu"]),
             h.make_node("Mul", ["silu", "b"], ["y"]), h.make_node("Mul", ["y", "c"], ["yc"]),
             h.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0)]
    inputs = [h.make_tensor_value_info(k, T.FLOAT, [n]) for k in ("ain", "bin", "c")]
    graph = h.make_graph(nodes, "swiglu", inputs, [h.make_tensor_value_info("loss", T.FLOAT, [])],
                         initializer=[h.make_tensor("one", T.FLOAT, [], [1.0])])
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10))
    return build_training_graph(model, optimizer=None, params=[], trainable_inputs=["ain", "bin"])


def test_swiglu_kernel_is_the_rules_op_sequence_bit_for_bit():
    """da and db equal numpy's float32 evaluation of the Mul and Sigmoid rules' ops in their
    order (with ORT's own Sigmoid for s), bit for bit, unlowered and lowered: a kernel with
    another association (``(s * (1 - s)) * dh * a``) fails here."""
    n = 1 << 14
    step = _swiglu_only(n)
    lowered = _copy(step)
    assert fuse_swiglu_grad(lowered) == 1 and _ops(lowered)["Sum"] == 0
    rng = np.random.default_rng(0)
    a = np.concatenate([np.linspace(-20, 20, n // 2, dtype=np.float32), 4 * rng.standard_normal(n // 2).astype(np.float32)])
    feeds = {"ain": a, "bin": rng.standard_normal(n).astype(np.float32), "c": rng.standard_normal(n).astype(np.float32)}
    b, dy = feeds["bin"], feeds["c"]
    s = run_named(_sigmoid((n,)), {"a": a})["s"]  # ORT's Sigmoid, as the step's forward computes it
    one = np.float32(1)
    dh = dy * b
    da = dh * s + (dh * a) * (s * (one - s))
    db = dy * (a * s)
    for model in (step, lowered):
        got = run_named(model, feeds, library=True)
        np.testing.assert_array_equal(got["grad/ain"], da)
        np.testing.assert_array_equal(got["grad/bin"], db)
    assert not np.array_equal(da, dh * s + (s * (one - s)) * dh * a)  # the other association differs here


def test_swiglu_forward_fuses_once_its_backward_reads_no_product(step):
    """While the backward's ops read ``a * s``, the forward stays three ops; after
    ``fuse_swiglu_grad`` it is one ``SwiGlu`` whose s the fused backward reads, and the step
    still matches the unlowered one on ORT CPU (s through the kernel's exp, not MLAS's: within
    float32 rounding)."""
    assert fuse_swiglu(_copy(step)) == 0
    lowered = _copy(step)
    assert _both(lowered) == (1, 1) and fuse_swiglu(lowered) == 1
    ops = _ops(lowered)
    assert ops["SwiGlu"] == 1 and ops["Sigmoid"] == 0 and ops["Mul"] == _ops(step)["Mul"] - 15
    forward = next(n for n in lowered.graph if n.op_type == "SwiGlu")
    assert {u.node.op_type for u in forward.outputs[1].uses()} == {"SwiGluGrad"}
    feeds = ab.block_feeds(SHAPE)
    want, got = run_named(step, feeds), run_named(lowered, feeds, library=True)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6 * np.abs(value).max(), err_msg=name)
    assert fuse_swiglu(lowered) == 0


def _sigmoid(shape: tuple[int, ...]) -> ir.Model:
    from onnx import TensorProto as T
    from onnx import helper as h

    graph = h.make_graph([h.make_node("Sigmoid", ["a"], ["s"])], "s", [h.make_tensor_value_info("a", T.FLOAT, shape)],
                         [h.make_tensor_value_info("s", T.FLOAT, shape)])
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10))


def _norm_read_twice(n: int, d: int) -> ir.Model:
    """``n = RMSNormalization(x, gamma)`` read by two branches through a bfloat16 round trip
    (``Cast`` to bfloat16 and back, which ORT CPU runs), so n's gradient is the float32 ``Sum``
    of two ``Cast``s from bfloat16: the shape of a bf16 step's norm backward, on ORT CPU."""
    from onnx import TensorProto as T
    from onnx import helper as h

    from mpgraph.training import build_training_graph

    k = h.make_node
    nodes = [k("RMSNormalization", ["x", "gamma"], ["n"], axis=-1, epsilon=1e-6)]
    for i in (1, 2):
        nodes += [k("Cast", ["n"], [f"nb{i}"], to=T.BFLOAT16), k("Cast", [f"nb{i}"], [f"n{i}"], to=T.FLOAT),
                  k("Mul", [f"n{i}", f"w{i}"], [f"y{i}"])]
    nodes += [k("Add", ["y1", "y2"], ["y"]), k("ReduceSum", ["y"], ["loss"], keepdims=0)]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [n, d]), h.make_tensor_value_info("gamma", T.FLOAT, [d]),
              h.make_tensor_value_info("w1", T.FLOAT, [n, d]), h.make_tensor_value_info("w2", T.FLOAT, [n, d])]
    graph = h.make_graph(nodes, "norm2", inputs, [h.make_tensor_value_info("loss", T.FLOAT, [])])
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10))
    return build_training_graph(model, optimizer=None, params=[], trainable_inputs=["x", "gamma"])


def test_norm_reads_the_bfloat16_parts_of_its_dy():
    """RmsNormGrad takes the two bfloat16 values (widening on load, as their Casts did), the
    Casts and the Sum go, and x's and gamma's gradients match the unlowered step on ORT CPU."""
    step = _norm_read_twice(64, 48)
    before = _ops(step)
    lowered = _copy(step)
    assert fuse_rmsnorm_grad(lowered) == 1
    norm = next(n for n in lowered.graph if n.op_type == "RmsNormGrad")
    assert [v.dtype for v in norm.inputs[3:]] == [ir.DataType.BFLOAT16] * 2
    assert before["Sum"] - _ops(lowered)["Sum"] == 1 and before["Cast"] - _ops(lowered)["Cast"] == 2
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((64, 48)).astype(np.float32),
             "gamma": (1 + 0.1 * rng.standard_normal(48)).astype(np.float32),
             "w1": rng.standard_normal((64, 48)).astype(np.float32), "w2": rng.standard_normal((64, 48)).astype(np.float32)}
    want, got = run_named(step, feeds), run_named(lowered, feeds, library=True)
    for name in ("grad/x", "grad/gamma"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-6 * np.abs(want[name]).max(), err_msg=name)


def test_what_is_left_alone(step):
    """A SwiGLU whose Sigmoid output another forward node reads (its gradient has a third
    term); a backward node a policy recorded in another precision; an RMSNorm over another
    axis than the last alone."""
    shared = _copy(step)
    sigmoid = next(n for n in shared.graph if n.op_type == "Sigmoid")
    extra = ir.node("Identity", [sigmoid.outputs[0]], metadata_props={NODE_ROLE: Role.FORWARD})
    shared.graph.insert_after(sigmoid, extra)
    assert fuse_swiglu_grad(shared) == 0

    recorded = _copy(step)
    for node, block in gradient_blocks(recorded.graph).items():
        if node.op_type in ("Sigmoid", "RMSNormalization"):
            block.dxs[0].producer().metadata_props[NODE_PRECISION] = "bfloat16"
    assert _both(recorded) == (0, 0)

    axis = _copy(step)
    norm = next(n for n in axis.graph if n.op_type == "RMSNormalization")
    norm.attributes["axis"] = ir.AttrInt64("axis", 1)
    assert fuse_rmsnorm_grad(axis) == 0


def test_bf16_step_plans_a_bfloat16_swiglu_and_a_float32_norm_for_cuda():
    """The bf16 policy keeps the norm float32 and runs the SwiGLU in bfloat16; for CUDA the
    fused SwiGLU node replaces a's float32 sum and the Casts around it, and takes dy, a, b and
    s in bfloat16; the norm's reads the gate and up projections' bfloat16 input gradients
    that the graph cast and summed into its dy."""
    low = ab.block_step(SHAPE, low=True)
    assert _ops(low)["Sum"] >= 1
    plan = plan_session(low, "cuda", PlanOptions(scope="all"))
    applied = dict(plan.applied)
    assert applied["rmsnorm_grad"] == 1 and applied["swiglu_grad"] == 1
    lowered = ir.from_proto(onnx.load_from_string(plan.graph))
    swiglu = next(n for n in lowered.graph if n.op_type == "SwiGluGrad")
    assert [v.dtype for v in (*swiglu.inputs, *swiglu.outputs)] == [ir.DataType.BFLOAT16] * 6
    alone = _copy(low)  # the rule alone (later rules of the plan rewrite Sums and Casts too)
    assert fuse_swiglu_grad(alone) == 1
    assert _ops(low)["Sum"] - _ops(alone)["Sum"] == 1  # a's float32 sum
    assert _ops(low)["Cast"] - _ops(alone)["Cast"] == 3  # to float32 twice, and back
    assert {u.node.op_type for u in swiglu.outputs[0].uses()} <= {"MatMul", "FusedMatMul", "Gemm", "Reshape",
                                                                  "Flatten", "Transpose"}
    norm = next(n for n in lowered.graph if n.op_type == "RmsNormGradAdd")  # x, scale, eps, the residual's gradient;
    assert [v.dtype for v in norm.inputs] == [ir.DataType.FLOAT] * 4 + [ir.DataType.BFLOAT16] * 2  # dy: gate, up


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tiny_hf_llama_lowers_on_both_exporters(exporter, tmp_path):
    """The tiny HF Llama (2 layers: 5 norms, 2 MLPs) from either torch exporter, float32 step:
    every norm and SwiGLU backward fuses and the step agrees with the unlowered one on ORT CPU."""
    rm = load_benchmark("real_models")
    job = rm.PrepJob(model="llama", exporter=exporter, small=True, seed=0, policies=("fp32",), emulate=False,
                     target="cuda", workdir=str(tmp_path))
    out = rm.prepare(job)
    assert not out["errors"], out["errors"]
    step = ir.load(out["graphs"]["fp32"])
    plan = plan_session(step, "cpu", PlanOptions(scope="all"))
    applied = dict(plan.applied)
    assert applied["rmsnorm_grad"] == 5 and applied["swiglu_grad"] == 2
    lowered = ir.from_proto(onnx.load_from_string(plan.graph))
    assert _ops(lowered)["ReduceMean"] == 0
    feeds = ab.feeds_for(step)
    want, got = run_named(step, feeds), run_named(lowered, feeds, library=True)
    for name, value in want.items():
        if value.dtype.kind == "f" and value.size:
            # 2e-4: AdamW's first step is m / sqrt(v) ~ sign(g): where a gradient cancels to about
            # eps, float32 rounding moves it; the cross_entropy rule's sums in another order moved
            # one element of layers.1 k_proj by 8.2e-6 = 1.05e-4 of max (both exporters).
            np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-4 * np.abs(value).max(), err_msg=name)
