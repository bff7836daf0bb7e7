"""The ``pointwise`` rule: convex groups of elementwise ops as one ``Pointwise`` register program.

Each hand-built graph runs on ORT CPU unlowered and lowered (the kernel library's CPU loop) and
must give the same bits: a float32 residual ``Add(x, Cast(y_bf16))``, a ``Sum`` of casts, a
chain with constants and a bias vector, reshapes between the ops; a non-convex pair is left
alone; a value read outside its group becomes an output. bfloat16 values are made inside the
graphs (ORT's Python API feeds no bfloat16), so the programs round to bfloat16 and float16
where the ops do; one test shows that dropping that rounding changes the bits. The zoo GPT's
emulated bf16 and fp16 AdamW steps agree bit for bit; its native bf16 CUDA plan fuses each
residual. About 4 CPU-s. The CUDA kernel against ORT CUDA's own ops: the ``gpu`` test at the end.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph.convert import convert
from mpgraph.lowering.plan import _apply
from mpgraph.lowering.pointwise import MAX_PROGRAM, fuse_pointwise
from mpgraph.lowering.registry import Target
from mpgraph.lowering.specialize import specialize_shapes
from mpgraph.training import build_training_graph
from tests.helpers import init, make_model, run_named, vi
from tests.test_lowering_blocks import GPT, _copy, _feeds

SHAPE = [4, 6, 16]
F = np.float32


def _model(nodes, inputs, outputs, initializers=()) -> ir.Model:
    proto = make_model(nodes, [vi(n, s) for n, s in inputs], [vi(n, None, t) for n, t in outputs], initializers, opset=20)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def _feeds_for(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Values whose float32 sums carry bits below bfloat16's and float16's mantissas."""
    rng = np.random.default_rng(seed)
    return {v.name: (rng.standard_normal([int(d) for d in v.shape]) * 37.3).astype(F) for v in model.graph.inputs}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


def _lowered(model: ir.Model) -> tuple[ir.Model, int]:
    lowered = _copy(model)
    return lowered, fuse_pointwise(lowered)


def _check(model: ir.Model, kernels: int) -> ir.Model:
    """Lower, count the ``Pointwise`` nodes, and compare every output bit for bit."""
    lowered, made = _lowered(model)
    assert made == kernels
    feeds = _feeds_for(model)
    want, got = run_named(model, feeds), run_named(lowered, feeds, library=True)
    for name, value in want.items():
        assert _same_bits(got[name], value), name
    return lowered


def _ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def residual() -> ir.Model:
    """x + float(bf16(y)), and its bfloat16 copy for the next GEMM (read outside: Identity)."""
    nodes = [h.make_node("Cast", ["y"], ["y_bf16"], to=T.BFLOAT16), h.make_node("Cast", ["y_bf16"], ["y_f32"], to=T.FLOAT),
             h.make_node("Add", ["x", "y_f32"], ["r"]), h.make_node("Cast", ["r"], ["r_bf16"], to=T.BFLOAT16),
             h.make_node("Identity", ["r_bf16"], ["gemm_in"]), h.make_node("Cast", ["gemm_in"], ["out"], to=T.FLOAT)]
    return _model(nodes, [("x", SHAPE), ("y", SHAPE)], [("r", T.FLOAT), ("out", T.FLOAT)])


def test_a_residual_add_of_a_cast_is_one_kernel_with_the_same_bits():
    lowered = _check(residual(), 1)
    (pw,) = [n for n in lowered.graph if n.op_type == "Pointwise"]
    assert _ops(lowered) == Counter({"Pointwise": 1, "Identity": 1, "Cast": 1})  # the Cast after Identity: alone
    assert [v.dtype for v in pw.outputs] == [ir.DataType.FLOAT, ir.DataType.BFLOAT16]  # r and r_bf16
    assert pw.attributes["program"].as_string().count("16") >= 2  # rounds twice to bfloat16


def test_a_sum_of_casts_adds_in_its_input_order():
    """The backward's residual-gradient accumulation: Sum(g, float(bf16(a)), float(fp16(b)))."""
    nodes = [h.make_node("Cast", ["a"], ["a16"], to=T.BFLOAT16), h.make_node("Cast", ["a16"], ["af"], to=T.FLOAT),
             h.make_node("Cast", ["b"], ["b16"], to=T.FLOAT16), h.make_node("Cast", ["b16"], ["bf"], to=T.FLOAT),
             h.make_node("Sum", ["g", "af", "bf"], ["s"])]
    lowered = _check(_model(nodes, [("g", SHAPE), ("a", SHAPE), ("b", SHAPE)], [("s", T.FLOAT)]), 1)
    assert _ops(lowered) == Counter({"Pointwise": 1})


def test_a_chain_with_constants_a_bias_and_reshapes():
    """Scalars, a bias along the last axis, a view in the middle, float32 Div, Sqrt and Neg."""
    flat, back = np.array([24, 16], np.int64), np.array(SHAPE, np.int64)
    nodes = [h.make_node("Mul", ["x", "half"], ["m"]), h.make_node("Add", ["m", "bias"], ["a"]),
             h.make_node("Reshape", ["a", "flat"], ["a2"]), h.make_node("Mul", ["a2", "a2"], ["p"]),
             h.make_node("Sqrt", ["p"], ["q"]), h.make_node("Div", ["q", "three"], ["d"]),
             h.make_node("Reshape", ["d", "back"], ["d3"]), h.make_node("Sub", ["d3", "y"], ["e"]),
             h.make_node("Neg", ["e"], ["n"]), h.make_node("Cast", ["n"], ["nb"], to=T.BFLOAT16),
             h.make_node("Cast", ["nb"], ["z"], to=T.FLOAT)]
    consts = [init("half", np.array(0.5, F)), init("three", np.array([3.0], F)), init("bias", np.linspace(-2, 2, 16, dtype=F)),
              init("flat", flat), init("back", back)]
    lowered = _check(_model(nodes, [("x", SHAPE), ("y", SHAPE)], [("z", T.FLOAT)], consts), 1)
    assert _ops(lowered) == Counter({"Pointwise": 1})


def test_a_non_convex_pair_is_left_alone():
    """a = x + y feeds a Relu (no member) and b = a * Relu(a): fusing Add and Mul would put the
    Relu both after and before the fused node."""
    nodes = [h.make_node("Add", ["x", "y"], ["a"]), h.make_node("Relu", ["a"], ["r"]), h.make_node("Mul", ["a", "r"], ["b"])]
    model = _model(nodes, [("x", SHAPE), ("y", SHAPE)], [("b", T.FLOAT)])
    _, made = _lowered(model)
    assert made == 0


def test_a_value_read_outside_its_group_becomes_an_output():
    """a is a graph output and feeds a Relu; b = a * 2 goes on in the group: two outputs, and
    the Relu's own chain after it is a second group."""
    nodes = [h.make_node("Add", ["x", "y"], ["a"]), h.make_node("Mul", ["a", "two"], ["b"]),
             h.make_node("Relu", ["a"], ["r"]), h.make_node("Sub", ["b", "r"], ["c"]), h.make_node("Mul", ["c", "two"], ["d"])]
    model = _model(nodes, [("x", SHAPE), ("y", SHAPE)], [("a", T.FLOAT), ("d", T.FLOAT)], [init("two", np.array(2.0, F))])
    lowered = _check(model, 2)
    first, second = [n for n in lowered.graph if n.op_type == "Pointwise"]
    assert [v.name for v in first.outputs] == ["a", "b"] and [v.name for v in second.outputs] == ["d"]


def test_dropping_the_rounding_inside_the_program_changes_the_bits():
    """The residual's program with its bfloat16 roundings turned into float32 ones no longer
    matches the ops: the bit-identity tests above see the rounding."""
    model = residual()
    lowered, _ = _lowered(model)
    pw = next(n for n in lowered.graph if n.op_type == "Pointwise")
    program = pw.attributes["program"].as_string()
    pw.attributes["program"] = ir.AttrString("program", program.replace(" 16", " 1"))
    feeds = _feeds_for(model)
    want, got = run_named(model, feeds), run_named(lowered, feeds, library=True)
    assert not _same_bits(got["r"], want["r"])


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_the_zoo_gpt_emulated_step_is_the_same_bits(policy):
    """The emulated step's round trips (float32 ops, Casts to the policy's type and back) fuse,
    the AdamW step's every output (parameters, moments, loss, scale state) the same bits."""
    step = convert(build_training_graph(GPT, optimizer="adamw"), policy, emulate=True, validate=False, calibrate=None)
    lowered, made = _lowered(step)
    assert made >= 30
    feeds = _feeds(step)
    want, got = run_named(step, feeds), run_named(lowered, feeds, library=True)
    assert set(got) == set(want)
    for name, value in want.items():
        assert _same_bits(got[name], value), name
    assert fuse_pointwise(lowered) == 0  # a second run finds nothing


def test_the_zoo_gpt_bf16_cuda_plan_fuses_every_residual():
    """Native bf16, every CUDA rule (no GPU needed to lower): each of the four residual adds
    of a GEMM's bfloat16 output and its bias is one kernel, and the rule runs last."""
    step = convert(build_training_graph(GPT, optimizer="adamw"), "bf16", emulate=False, validate=False, calibrate=None)
    step = specialize_shapes(step, {"tokens": [2, 16], "label": [2, 16]})  # as for CUDA graph capture
    before = _ops(step)
    applied = _apply(step, Target("cuda", "all"), False)
    # free_early only reorders; recompute copies SwiGlus (none here) after pointwise
    rewrites = [(name, n) for name, n in applied if name not in ("recompute", "free_early")]
    assert rewrites[-1] == ("pointwise", 8)
    programs = Counter(n.attributes["program"].as_string() for n in step.graph if n.op_type == "Pointwise")
    print(programs)
    assert programs["cvt 0 0 -1 1;add 0 0 2 1;add 2 1 0 1"] == 4  # x + (float(gemm) + bias)
    assert _ops(step)["Add"] < before["Add"] - 8


def test_a_chain_longer_than_a_program_is_split():
    """40 Adds of a scalar: a kernel of MAX_PROGRAM instructions, then one of the other 8."""
    nodes = [h.make_node("Add", [f"v{i}", "one"], [f"v{i + 1}"]) for i in range(40)]
    model = _model(nodes, [("v0", SHAPE)], [("v40", T.FLOAT)], [init("one", np.array(1.0009765625, F))])
    lowered = _check(model, 2)
    assert [len(n.attributes["program"].as_string().split(";")) for n in lowered.graph] == [MAX_PROGRAM, 40 - MAX_PROGRAM]


def test_on_cpu_an_op_computing_in_float16_is_left_out():
    """ORT CPU runs a float16 Mul in float32 behind Casts it inserts and drops: the CPU rule
    (``low=False``) keeps it out, the CUDA one takes it."""
    nodes = [h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16), h.make_node("Mul", ["x16", "x16"], ["m16"]),
             h.make_node("Cast", ["m16"], ["m"], to=T.FLOAT)]
    model = _model(nodes, [("x", SHAPE)], [("m", T.FLOAT)])
    assert fuse_pointwise(_copy(model), low=False) == 0 and fuse_pointwise(_copy(model)) == 1


def test_a_view_read_outside_stays_and_reads_the_fused_output():
    """The backward's residual gradient: s = Sum(g, dx) is viewed as [rows, 16] for a weight
    gradient (ReduceSum here) and cast to bfloat16 through that view: the Reshape stays, over
    the fused node's s, and the cast is in the kernel."""
    rows = np.array([24, 16], np.int64)
    nodes = [h.make_node("Sum", ["g", "dx"], ["s"]), h.make_node("Reshape", ["s", "rows"], ["s2"]),
             h.make_node("Cast", ["s2"], ["s2_bf16"], to=T.BFLOAT16), h.make_node("Identity", ["s2_bf16"], ["gemm_in"]),
             h.make_node("Cast", ["gemm_in"], ["back"], to=T.FLOAT),
             h.make_node("ReduceSum", ["s2", "axis0"], ["dw"], keepdims=0), h.make_node("Mul", ["s", "s"], ["next"])]
    model = _model(nodes, [("g", SHAPE), ("dx", SHAPE)], [("back", T.FLOAT), ("dw", T.FLOAT), ("next", T.FLOAT)],
                   [init("rows", rows), init("axis0", np.array([0], np.int64))])
    lowered = _check(model, 1)
    (pw,) = [n for n in lowered.graph if n.op_type == "Pointwise"]
    view = next(n for n in lowered.graph if n.op_type == "Reshape")
    assert view.inputs[0].producer() is pw and len(pw.outputs) == 3  # s (for the view), s2_bf16, next
