"""The ``gelu`` rule on the tanh form: ``Gelu(approximate="tanh")``'s backward (GPT-2's
``gelu_new``; its gradient rule's 16 elementwise ops) as one ``TanhGeluGrad``, found by the
Gelu's gradient block.

Exactness (``same math``), shown bit for bit on ORT CPU in float32: the unlowered step equals
the rule's op sequence evaluated by numpy with ORT's own Tanh, and the lowered step equals the
same sequence with glibc's ``tanhf`` (what the CPU kernel calls). The two differ only in how
their tanh rounds (MLAS against glibc, a few ulp), which the rule's ``1 + t`` and ``1 - t*t``
amplify where tanh saturates. The CUDA kernel in bfloat16 is ``tests/test_gpu_gelu.py``.
About 3 CPU-s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper as h

from mpgraph._ir.links import gradient_blocks
from mpgraph._ir.meta import NODE_PRECISION
from mpgraph.convert import convert
from mpgraph.lowering import PlanOptions, plan_session
from mpgraph.lowering.gelu import fuse_gelu
from mpgraph.lowering.match import interior
from mpgraph.training import build_training_graph
from tests.helpers import init, make_model, run_named, vi
from tests.test_lowering_blocks import _agree, _copy, _ops, _written_out_block

F = np.float32
C = F(np.sqrt(2.0 / np.pi))
CK, CK3 = F(np.sqrt(2.0 / np.pi) * 0.044715), F(3 * np.sqrt(2.0 / np.pi) * 0.044715)
N = 4096


def rule_sequence(x: np.ndarray, dy: np.ndarray, tanh) -> np.ndarray:
    """``autodiff.rules.elementwise.gelu``'s tanh branch, op by op in float32 (numpy rounds
    each float32 op as ORT's kernels do), with ``tanh`` the one op whose rounding is free."""
    x2 = x * x
    t = tanh(x * (C + x2 * CK))
    dinner = C + x2 * CK3
    return dy * (F(0.5) * (F(1) + t) + (F(0.5) * x) * ((F(1) - t * t) * dinner))


def _glibc_tanhf(v: np.ndarray) -> np.ndarray:
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.array([libm.tanhf(float(e)) for e in v], np.float32)


def _ort_tanh(v: np.ndarray) -> np.ndarray:
    model = make_model([h.make_node("Tanh", ["x"], ["y"])], [vi("x", [len(v)])], [vi("y", [len(v)])])
    return run_named(ir.from_proto(model), {"x": v})["y"]


@pytest.fixture(scope="module")
def gelu_grads() -> ir.Model:
    """``loss = sum(Gelu_tanh(x) * c)`` with x trainable: ``grad/x`` is the rule's dx for dy = c."""
    nodes = [h.make_node("Gelu", ["x"], ["y"], approximate="tanh"), h.make_node("Mul", ["y", "c"], ["z"]),
             h.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    proto = make_model(nodes, [vi("x", [N]), vi("c", [N])], [vi("loss", [])], opset=20)
    return build_training_graph(ir.from_proto(proto), optimizer=None, params=[], trainable_inputs=["x"])


def _inputs() -> dict[str, np.ndarray]:
    """x over the whole range (saturated tails, zero, both signs) and at random; dy at random."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-12, 12, N // 2, dtype=F), 3 * rng.standard_normal(N // 2).astype(F)])
    return {"x": x, "c": rng.standard_normal(N).astype(F)}


def test_tanh_gelu_backward_is_one_kernel_equal_to_the_rules_ops_but_for_tanh(gelu_grads):
    """The 16 ops (one Tanh among them) go, the forward Gelu stays; the unlowered dx is the
    rule's sequence with ORT's Tanh, the lowered one the same sequence with glibc's tanhf."""
    ops = _ops(gelu_grads)
    assert ops["Tanh"] == 1 and ops["Mul"] + ops["Add"] + ops["Sub"] >= 15
    lowered = _copy(gelu_grads)
    assert fuse_gelu(lowered) == 1
    after = _ops(lowered)
    assert after["TanhGeluGrad"] == 1 and after["Gelu"] == 1 and after["Tanh"] == after["Sub"] == 0
    assert after["Add"] == 0 and after["ErfGeluGrad"] == 0
    feeds = _inputs()
    plain, fused = run_named(gelu_grads, feeds)["grad/x"], run_named(lowered, feeds, library=True)["grad/x"]
    x, dy = feeds["x"], feeds["c"]
    np.testing.assert_array_equal(plain, rule_sequence(x, dy, _ort_tanh))
    np.testing.assert_array_equal(fused, rule_sequence(x, dy, _glibc_tanhf))
    assert not np.array_equal(plain, fused)  # the two tanh do differ here: the test can tell
    assert fuse_gelu(lowered) == 0  # lowered twice: nothing left to fuse


def test_written_out_tanh_gelu_fuses_after_canonicalisation():
    """The torch exporters' tanh formula becomes ``Gelu(approximate="tanh")`` before
    differentiating; its backward lowers with the LayerNorm's, and the steps agree on ORT CPU."""
    grads = build_training_graph(_written_out_block("tanh"), optimizer=None, params=["w", "b", "gamma", "beta", "v"])
    gelu = next(n for n in grads.graph if n.op_type == "Gelu")
    assert gelu.attributes.get_string("approximate") == "tanh"
    plan = plan_session(grads, "cpu", PlanOptions(scope="all"))
    applied = dict(plan.applied)
    assert applied["gelu"] == 1 and applied["layernorm_grad"] == 1
    lowered = ir.from_proto(__import__("onnx").load_from_string(plan.graph))
    assert _ops(lowered)["TanhGeluGrad"] == 1 and _ops(lowered)["Tanh"] == 0
    _agree(grads, lowered, 2e-6)


def _mlp_block() -> ir.Model:
    """``loss = sum(c * (gelu_tanh(x w + b) v))``: the GELU reads a matmul's output, as GPT-2's
    MLP does, so a bf16 policy runs it (and its backward) in bfloat16."""
    rng = np.random.default_rng(0)
    n = h.make_node
    nodes = [n("MatMul", ["x", "w"], ["xw"]), n("Add", ["xw", "b"], ["a"]), n("Gelu", ["a"], ["g"], approximate="tanh"),
             n("MatMul", ["g", "v"], ["o"]), n("Mul", ["o", "cw"], ["oc"]), n("ReduceSum", ["oc"], ["loss"], keepdims=0)]
    inits = [init("w", rng.standard_normal((6, 16)).astype(F)), init("b", rng.standard_normal(16).astype(F)),
             init("v", rng.standard_normal((16, 4)).astype(F)), init("cw", rng.standard_normal((5, 4)).astype(F))]
    return ir.from_proto(make_model(nodes, [vi("x", [5, 6])], [vi("loss", [])], inits, opset=20))


def _bf16_step(emulate: bool = False) -> ir.Model:
    grads = build_training_graph(_mlp_block(), optimizer="adamw", params=["w", "b", "v"], target="cuda")
    return convert(grads, "bf16", emulate=emulate, validate=False, calibrate=None, target="cuda")


def test_bf16_step_lowers_tanh_gelu_for_cuda_in_bf16():
    """The bf16 step: the Gelu, its dy and dx are bfloat16, and the backward is one bfloat16
    ``TanhGeluGrad`` whose scalars are the rule's (float32, then bfloat16)."""
    step = _bf16_step()
    gelu = next(n for n in step.graph if n.op_type == "Gelu")
    assert gelu.inputs[0].dtype == ir.DataType.BFLOAT16
    plan = plan_session(step, "cuda", PlanOptions(scope="all"))
    assert dict(plan.applied)["gelu"] == 1
    lowered = ir.from_proto(__import__("onnx").load_from_string(plan.graph))
    grad = next(n for n in lowered.graph if n.op_type == "TanhGeluGrad")
    assert [v.dtype for v in grad.inputs] == [ir.DataType.BFLOAT16] * 7
    consts = [float(v.const_value.numpy()) for v in grad.inputs[2:]]
    want = [float(np.array(v, dtype=ir.DataType.BFLOAT16.numpy())) for v in (C, CK, CK3, F(1), F(0.5))]
    assert consts == want
    assert _ops(lowered)["Tanh"] == 0


def test_a_tanh_gelu_backward_partly_in_float32_or_emulated_keeps_its_ops():
    """One node of the rule's backward recorded as float32 (a policy's decision), or the
    emulated bf16 step (float32 ops with rounding Casts): the kernel would round otherwise."""
    step = _bf16_step()
    gelu, block = next((n, b) for n, b in gradient_blocks(step.graph).items() if n.op_type == "Gelu")
    inner = interior(block.dxs, [*block.dys, *gelu.inputs, *gelu.outputs])
    assert Counter(n.op_type for n in inner)["Tanh"] == 1
    assert fuse_gelu(_copy(step)) == 1
    next(n for n in inner if n.op_type == "Tanh").metadata_props[NODE_PRECISION] = "float32"
    assert fuse_gelu(_copy(step)) == 0
    plan = plan_session(_bf16_step(emulate=True), "cpu", PlanOptions(scope="all"))
    assert dict(plan.applied)["gelu"] == 0
