"""The ``rotary`` lowering (``mpgraph/lowering/rotary.py``): ONNX ``RotaryEmbedding`` as the
library's kernel, against ORT's own ``RotaryEmbedding`` on ORT CPU.

Every form the op has: 3-D with ``num_heads`` and 4-D X, interleaved or not, with
``position_ids`` (2-D caches) or without (3-D caches), the whole head rotated or a partial
``rotary_embedding_dim``. The library's CPU loop computes each pair as MLAS's AVX2 kernel does
(float, ``fma``, one rounding an output), so on a CPU where ORT takes that path the outputs are
ORT's bits. Elsewhere within 2 float32 ulps of max |y|: on a CPU without AVX2 and FMA MLAS's
scalar fallback rounds ``x1 * cos`` first, and so does ORT 1.32's AVX2 kernel for every pair but
the first of an interleaved rotation shorter than 16 (measured: ``3d-partial-interleaved``,
rotary_embedding_dim 12, pairs 1-5 are ``round(x1 * cos) - round(x2 * sin)``).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mpgraph.lowering.rotary import fuse_rotary
from tests.helpers import run_named

B, S, N, H = 2, 5, 3, 16


def _cpu_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _assert_as_ort(got: np.ndarray, want: np.ndarray, *, exact: bool = True, name: str = "") -> None:
    """``got`` equals ORT CPU's ``want`` bit for bit where its kernel rounds as the CPU loop does
    (AVX2 with FMA, and ``exact``), else within 2 float32 ulps of max |want|."""
    if exact and _cpu_has_fma():
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=2 * np.finfo(np.float32).eps * np.abs(want).max(),
                                   err_msg=name)


def _rotary(*, rank: int, interleaved: int, positions: bool, rdim: int = 0,
            dtype: int = TensorProto.FLOAT) -> ir.Model:
    x_shape = [B, S, N * H] if rank == 3 else [B, N, S, H]
    half = (rdim or H) // 2
    cache = [S + 3, half] if positions else [B, S, half]
    inputs = [helper.make_tensor_value_info("x", dtype, x_shape), helper.make_tensor_value_info("cos", dtype, cache),
              helper.make_tensor_value_info("sin", dtype, cache)]
    if positions:
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [B, S]))
    attrs = {"interleaved": interleaved}
    if rank == 3:
        attrs["num_heads"] = N
    if rdim:
        attrs["rotary_embedding_dim"] = rdim
    node = helper.make_node("RotaryEmbedding", [i.name for i in inputs], ["y"], name="rope", **attrs)
    graph = helper.make_graph([node], "rope", inputs, [helper.make_tensor_value_info("y", dtype, x_shape)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    return ir.from_proto(proto)


def _feeds(model: ir.Model, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        shape = [int(d) for d in value.shape]
        if value.name == "pos":
            feeds["pos"] = rng.integers(0, S + 3, size=shape).astype(np.int64)
        elif value.name in ("cos", "sin"):
            angle = rng.uniform(-np.pi, np.pi, size=shape)
            feeds[value.name] = (np.cos(angle) if value.name == "cos" else np.sin(angle)).astype(np.float32)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32) * 3
    return feeds


FORMS = [
    pytest.param(dict(rank=3, interleaved=0, positions=False), id="3d"),
    pytest.param(dict(rank=3, interleaved=1, positions=False), id="3d-interleaved"),
    pytest.param(dict(rank=3, interleaved=0, positions=True), id="3d-positions"),
    pytest.param(dict(rank=4, interleaved=0, positions=True), id="4d-positions"),
    pytest.param(dict(rank=4, interleaved=1, positions=False), id="4d-interleaved"),
    pytest.param(dict(rank=3, interleaved=0, positions=True, rdim=8), id="3d-partial"),
    pytest.param(dict(rank=3, interleaved=1, positions=False, rdim=12), id="3d-partial-interleaved"),
    pytest.param(dict(rank=4, interleaved=0, positions=False, rdim=8), id="4d-partial"),
]


@pytest.mark.parametrize("form", FORMS)
def test_kernel_is_orts_rotary_embedding(form):
    model = _rotary(**form)
    feeds = _feeds(model, seed=len(str(form)))
    want = run_named(model, feeds)["y"]
    lowered = _rotary(**form)
    assert fuse_rotary(lowered, "cpu") == 1
    (node,) = list(lowered.graph)
    assert (node.domain, node.op_type) == ("ai.mpgraph", "RotaryEmbedding")
    assert {k: a.as_int() for k, a in node.attributes.items()} == \
        {k: a.as_int() for k, a in next(iter(model.graph)).attributes.items()}
    got = run_named(lowered, feeds, library=True)["y"]
    assert not np.array_equal(got, feeds["x"])  # it rotates
    _assert_as_ort(got, want, exact=not (form["interleaved"] and form.get("rdim", H) % 16))


def _expanded(*, negate: bool, share: bool = True) -> ir.Model:
    """Llama's planned backward: caches ``[1, S, half]`` expanded to the batch (ONNX asks
    ``[B, S, half]`` without position ids), sin negated, a 3-D rotary; with ``share`` the
    expanded caches are graph outputs too (read elsewhere: they stay)."""
    f32, half = TensorProto.FLOAT, H // 2
    inputs = [helper.make_tensor_value_info("x", f32, [B, S, N * H]),
              helper.make_tensor_value_info("cos", f32, [1, S, half]), helper.make_tensor_value_info("sin", f32, [1, S, half])]
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [B, S, half])
    nodes = [helper.make_node("Constant", [], ["to"], value=shape),
             helper.make_node("Expand", ["cos", "to"], ["cos_b"]), helper.make_node("Expand", ["sin", "to"], ["sin_b"])]
    sin = "sin_b"
    if negate:
        nodes.append(helper.make_node("Neg", ["sin_b"], ["nsin"]))
        sin = "nsin"
    nodes.append(helper.make_node("RotaryEmbedding", ["x", "cos_b", sin], ["y"], num_heads=N))
    outputs = [helper.make_tensor_value_info("y", f32, [B, S, N * H])]
    if share:
        outputs.append(helper.make_tensor_value_info("cos_b", f32, [B, S, half]))
    graph = helper.make_graph(nodes, "rope", inputs, outputs)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))  # a step graph records them


@pytest.mark.parametrize("negate", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_caches_read_before_expand_and_neg(negate, share):
    """The kernel reads ``[1, S, half]`` caches for every batch row and rotates by -sin itself
    (``negate_sin``): the rule reads the caches before the graph's Expand and Neg, which go when
    nothing else reads them, and the outputs keep ORT's bits."""
    model, lowered = _expanded(negate=negate, share=share), _expanded(negate=negate, share=share)
    rng = np.random.default_rng(3)
    angle = rng.uniform(-np.pi, np.pi, size=(1, S, H // 2))
    feeds = {"x": rng.standard_normal((B, S, N * H)).astype(np.float32) * 3,
             "cos": np.cos(angle).astype(np.float32), "sin": np.sin(angle).astype(np.float32)}
    assert fuse_rotary(lowered, "cpu") == 1
    node = next(n for n in lowered.graph if n.op_type == "RotaryEmbedding")
    assert [v.name for v in node.inputs] == ["x", "cos", "sin"]
    assert (node.attributes["negate_sin"].as_int() if "negate_sin" in node.attributes else 0) == int(negate)
    left = sorted(n.op_type for n in lowered.graph if n.op_type != "RotaryEmbedding")
    assert left == (["Constant", "Expand"] if share else [])
    want, got = run_named(model, feeds), run_named(lowered, feeds, library=True)
    for name, value in want.items():
        _assert_as_ort(got[name], value, name=name)


def test_what_is_left_alone():
    """A bfloat16 node on CPU (the CPU loop is float32), caches of another type than X, a 3-D X
    without ``num_heads``, an odd ``rotary_embedding_dim``; on CUDA the bfloat16 node is taken."""
    bf16 = _rotary(rank=3, interleaved=0, positions=True, dtype=TensorProto.BFLOAT16)
    assert fuse_rotary(bf16, "cpu") == 0
    assert fuse_rotary(bf16, "cuda") == 1
    mixed = _rotary(rank=3, interleaved=0, positions=True)
    mixed.graph.inputs[1].dtype = ir.DataType.FLOAT16
    assert fuse_rotary(mixed, "cuda") == 0
    no_heads = _rotary(rank=3, interleaved=0, positions=False)
    del next(iter(no_heads.graph)).attributes["num_heads"]
    assert fuse_rotary(no_heads, "cuda") == 0
    odd = _rotary(rank=4, interleaved=0, positions=False, rdim=8)
    next(iter(odd.graph)).attributes["rotary_embedding_dim"] = ir.AttrInt64("rotary_embedding_dim", 7)
    assert fuse_rotary(odd, "cuda") == 0


def test_switched_off_by_the_environment(monkeypatch):
    """``MPGRAPH_ROTARY=ort``: every rotary stays ORT's (a whole-step A/B)."""
    monkeypatch.setenv("MPGRAPH_ROTARY", "ort")
    assert fuse_rotary(_rotary(rank=3, interleaved=0, positions=False), "cpu") == 0
    monkeypatch.setenv("MPGRAPH_ROTARY", "")
    assert fuse_rotary(_rotary(rank=3, interleaved=0, positions=False), "cpu") == 1


def test_wrong_shapes_are_an_error_naming_the_op():
    """Caches that do not fit X: the kernel refuses with the op's name, never reads past them."""
    import onnxruntime as ort

    model = _rotary(rank=3, interleaved=0, positions=False)
    assert fuse_rotary(model, "cpu") == 1
    feeds = _feeds(_rotary(rank=3, interleaved=0, positions=False), seed=1)
    feeds["cos"] = feeds["cos"][:, :, :4].copy()
    feeds["sin"] = feeds["sin"][:, :, :4].copy()
    for value in model.graph.inputs[1:3]:
        value.shape = ir.Shape([B, S, 4])
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="RotaryEmbedding: without position_ids"):
        run_named(model, feeds, library=True)


def test_step_forward_and_gradient_nodes_both_lowered():
    """A float32 step through a 3-D rotary (Llama's planned form): the forward node and its
    gradient rule's ``RotaryEmbedding(dy, cos, -sin)`` both become the library's op, and the
    lowered step gives the unlowered step's loss and gradient bit for bit on ORT CPU (AVX2+FMA;
    elsewhere within 2 ulps)."""
    from mpgraph.lowering import PlanOptions, plan_session
    from mpgraph.training import build_training_graph

    f32 = TensorProto.FLOAT
    shape, cache = [B, S, N * H], [B, S, H // 2]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], num_heads=N),
             helper.make_node("Mul", ["y", "w"], ["z"]), helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(n, f32, s) for n, s in (("x", shape), ("cos", cache), ("sin", cache),
                                                                   ("w", shape))]
    graph = helper.make_graph(nodes, "rope_step", inputs, [helper.make_tensor_value_info("loss", f32, [])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    step = build_training_graph(ir.from_proto(proto), optimizer=None, params=[], trainable_inputs=["x"], target="cpu")
    assert sum(n.op_type == "RotaryEmbedding" for n in step.graph) == 2
    plan = plan_session(step, "cpu", PlanOptions(scope="all"))
    assert dict(plan.applied)["rotary"] == 2
    lowered = ir.from_proto(onnx.load_from_string(plan.graph))
    assert [n.domain for n in lowered.graph if n.op_type == "RotaryEmbedding"] == ["ai.mpgraph"] * 2
    assert not [n for n in lowered.graph if n.op_type == "Neg"]  # the gradient's -sin: negate_sin
    feeds = _feeds(_rotary(rank=3, interleaved=0, positions=False), seed=7)
    feeds["w"] = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    want, got = run_named(step, feeds), run_named(lowered, feeds, library=True)
    assert set(want) == set(got) and "grad/x" in str(sorted(want))
    for name, value in want.items():
        _assert_as_ort(got[name], value, name=name)


def test_llama_block_after_sdpa_layout_keeps_its_bits():
    """``test_lowering_sdpa_layout``'s Llama-form block (GQA, Q and K rotated, fused attention),
    after ``sdpa`` and ``sdpa_layout`` as a plan runs them: its four 3-D rotaries (Q, K and their
    gradients) are taken and every output of the AdamW step keeps its bits on ORT CPU."""
    from mpgraph.lowering.attention import fuse_attention
    from mpgraph.lowering.sdpa_layout import read_heads_in_place
    from mpgraph.lowering.specialize import specialize_shapes
    from mpgraph.training import build_training_graph
    from tests.test_lowering_sdpa_layout import _rotary_block

    step = specialize_shapes(build_training_graph(_rotary_block(), optimizer="adamw", lr=1e-2), {"x": [2, 8, 32]})
    assert fuse_attention(step, "cpu") == 1 and read_heads_in_place(step) == 1
    lowered = ir.from_proto(ir.to_proto(step))
    assert fuse_rotary(lowered, "cpu") == 4
    assert not [n for n in lowered.graph if n.op_type == "RotaryEmbedding" and n.domain == ""]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)}
    want, got = run_named(step, feeds, library=True), run_named(lowered, feeds, library=True)
    assert want.keys() == got.keys()
    for name, value in want.items():
        _assert_as_ort(got[name], value, name=name)
