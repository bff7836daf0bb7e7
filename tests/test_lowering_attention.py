"""The ``sdpa`` lowering rule (``mpgraph/lowering/attention.py``) and its CPU kernels.

The CPU ``SdpaForward``/``SdpaBackward`` loops against a float64 numpy reference; whole step
graphs lowered with the rule against the same graphs unlowered on ORT CPU (loss and every
gradient or updated parameter within float32 rounding); what the rule leaves alone; and the
CUDA rewrite checked structurally on a bf16 graph (it runs on the GPU machine only).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import mpgraph
from mpgraph._ir.links import gradient_blocks
from mpgraph.lowering import DOMAIN, PlanOptions, library, plan_session
from mpgraph.lowering.attention import fuse_attention
from mpgraph.lowering.registry import RULES, Target
from mpgraph.training import build_training_graph

RULE = next(r for r in RULES if r.name == "sdpa")
GPT = "models/onnx/gpt.loss.onnx"


# -- the kernels against numpy ----------------------------------------------------------------

def _reference(q, k, v, dy, scale, causal):
    """Float64 SDPA forward and backward on 4-D ``[B, H, S, D]`` arrays (GQA by repeating)."""
    reps = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, reps, axis=1), np.repeat(v, reps, axis=1)
    s = q @ kk.transpose(0, 1, 3, 2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    top = s.max(-1, keepdims=True)
    lse = top + np.log(np.exp(s - top).sum(-1, keepdims=True))
    p = np.exp(s - lse)
    y = p @ vv
    ds = p * (dy @ vv.transpose(0, 1, 3, 2) - (dy * y).sum(-1, keepdims=True))
    dq = scale * ds @ kk
    dk = scale * ds.transpose(0, 1, 3, 2) @ q
    dv = p.transpose(0, 1, 3, 2) @ dy

    def group(g):
        return g.reshape(g.shape[0], k.shape[1], reps, *g.shape[2:]).sum(2)

    return y, lse, dq, group(dk), group(dv)


def _to3(x):
    return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


def _kernel_model(shapes, attrs):
    n = helper.make_node
    nodes = [n("SdpaForward", ["q", "k", "v"], ["y", "stats"], domain=DOMAIN, **attrs),
             n("SdpaBackward", ["q", "k", "v", "y", "dy", "stats"], ["dq", "dk", "dv"], domain=DOMAIN, **attrs)]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "stats", "dq", "dk", "dv")]
    graph = helper.make_graph(nodes, "sdpa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])


CASES = {  # (B, Hq, Hkv, Sq, Skv, D, Dv, causal, scale attribute, 3-D)
    "mha-4d-causal": (2, 2, 2, 5, 5, 8, 8, 1, None, False),
    "mha-4d-cross-lengths": (1, 3, 3, 3, 6, 4, 6, 0, None, False),
    "gqa-3d-causal": (2, 4, 2, 6, 6, 4, 4, 1, None, True),
    "explicit-scale-causal-longer-queries": (1, 2, 1, 7, 4, 8, 8, 1, 0.3, False),
}


@pytest.mark.parametrize("case", CASES)
def test_cpu_kernels_match_float64(case: str) -> None:
    b, hq, hkv, sq, skv, d, dv, causal, scale, three = CASES[case]
    rng = np.random.default_rng(0)
    q, dy = rng.standard_normal((b, hq, sq, d)), rng.standard_normal((b, hq, sq, dv))
    k, v = rng.standard_normal((b, hkv, skv, d)), rng.standard_normal((b, hkv, skv, dv))
    q, k, v, dy = (t.astype(np.float32).astype(np.float64) for t in (q, k, v, dy))
    want = _reference(q, k, v, dy, 1 / np.sqrt(d) if scale is None else scale, causal)
    attrs = {"is_causal": causal, **({} if scale is None else {"scale": scale})}
    if three:
        attrs |= {"q_num_heads": hq, "kv_num_heads": hkv}
        feeds = {"q": _to3(q), "k": _to3(k), "v": _to3(v), "dy": _to3(dy)}
    else:
        feeds = {"q": q, "k": k, "v": v, "dy": dy}
    feeds = {name: t.astype(np.float32) for name, t in feeds.items()}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library("cpu")))
    model = _kernel_model({name: t.shape for name, t in feeds.items()}, attrs)
    got = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    for name, g, w in zip(("y", "stats", "dq", "dk", "dv"), got, want, strict=True):
        w = _to3(w) if three and name != "stats" else w
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert np.abs(g - w).max() <= 2e-6 * max(1.0, np.abs(w).max()), (name, np.abs(g - w).max())


# -- whole step graphs --------------------------------------------------------------------------

B, T, D = 2, 6, 16


def _block(heads: tuple[int, int], *, rank: int = 3, mask: bool = False, **attrs) -> onnx.ModelProto:
    """``loss = mean((x + Attention(x wq, x wk, x wv) wo)^2)``, causal, ``heads = (Hq, Hkv)``
    with head dim ``D / Hq``; 4-D Q, K, V through Reshape and Transpose when ``rank`` is 4."""
    hq, hkv = heads
    head = D // hq
    n = helper.make_node
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"])]
    qkv = ["q", "k", "v"]
    if rank == 4:
        for name, h in (("q", hq), ("k", hkv), ("v", hkv)):
            nodes += [n("Reshape", [name, f"shape_{h}"], [f"{name}_r"]),
                      n("Transpose", [f"{name}_r"], [f"{name}4"], perm=[0, 2, 1, 3])]
        qkv = ["q4", "k4", "v4"]
    inputs = [*qkv, "mask"] if mask else qkv
    heads_attrs = {"q_num_heads": hq, "kv_num_heads": hkv} if rank == 3 else {}
    nodes.append(n("Attention", inputs, ["a"], name="attn", is_causal=1, **heads_attrs, **attrs))
    if rank == 4:
        nodes += [n("Transpose", ["a"], ["a_t"], perm=[0, 2, 1, 3]), n("Reshape", ["a_t", "shape_flat"], ["a3"])]
    nodes += [n("MatMul", ["a3" if rank == 4 else "a", "wo"], ["o"]), n("Add", ["x", "o"], ["r"]),
              n("Mul", ["r", "r"], ["sq"]), n("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((D, cols)) / 4).astype(np.float32), name)
             for name, cols in (("wq", D), ("wk", hkv * head), ("wv", hkv * head), ("wo", D))]
    inits += [numpy_helper.from_array(np.array([0, 0, h, head], dtype=np.int64), f"shape_{h}") for h in {hq, hkv}]
    inits.append(numpy_helper.from_array(np.array([0, 0, D], dtype=np.int64), "shape_flat"))
    if mask:
        inits.append(numpy_helper.from_array(np.zeros((T, T), dtype=np.float32), "mask"))
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, D])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(graph: bytes, feeds: dict, custom_ops: str | None) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def _ops(model: ir.Model | bytes) -> Counter:
    if isinstance(model, bytes):
        model = ir.from_proto(onnx.load_from_string(model))
    return Counter(n.op_type for n in model.graph)


def _lowered_matches(step: ir.Model, feeds: dict) -> Counter:
    """Run ``step`` unlowered and lowered (scope ``all``); assert they agree; the lowered ops."""
    plan = plan_session(step, "cpu", PlanOptions(scope="all"))
    want = _run(ir.to_proto(step).SerializeToString(), feeds, None)
    got = _run(plan.graph, feeds, plan.custom_ops)
    assert got.keys() == want.keys()
    for name, w in want.items():
        err = np.linalg.norm(got[name].astype(np.float64) - w) / max(np.linalg.norm(w), 1e-30)
        assert err <= (1e-6 if name == "loss" else 1e-5), (name, err)
    return _ops(plan.graph)


@pytest.mark.parametrize(("heads", "rank", "optimizer"), [((4, 2), 3, None), ((2, 2), 4, None), ((4, 2), 3, "adamw")])
def test_step_graph_lowered_on_cpu_matches_the_unlowered_one(heads: tuple[int, int], rank: int, optimizer) -> None:
    step = build_training_graph(_block(heads, rank=rank), optimizer=optimizer)
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    ops = _lowered_matches(step, {"x": x})
    assert ops["SdpaForward"] == ops["SdpaBackward"] == 1
    assert not {"Attention", "Softmax", "Trilu"} & set(ops), ops


def test_canonicalized_gpt_step_lowers_every_attention() -> None:
    """The zoo GPT (eager attention, canonicalised into 4-D ``Attention`` with an explicit
    scale): both layers' attention and backward fused, the gradients the unlowered step's.

    Gradients, not AdamW's updates: the key bias's gradient is zero up to rounding (a constant
    added to every key of a query's scores leaves its softmax alone), and AdamW's first step
    turns that noise into +-lr."""
    step = build_training_graph(GPT, optimizer=None, canonicalize=True)
    assert _ops(step)["Attention"] == 2 and _ops(step)["Softmax"] == 2  # the backward's recomputed P
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 64, (2, 16)), "label": rng.integers(0, 64, (2, 16))}
    ops = _lowered_matches(step, feeds)
    assert ops["SdpaForward"] == ops["SdpaBackward"] == 2
    assert "Attention" not in ops and "Softmax" not in ops


def test_default_cpu_scope_leaves_attention_and_a_cpu_library_has_no_cuda_sdpa() -> None:
    step = build_training_graph(_block((2, 2)), optimizer=None)
    plan = plan_session(step, "cpu", PlanOptions())  # the CPU default: the library, scope "default"
    assert plan.scope == "default" and "sdpa" not in dict(plan.applied) and _ops(plan.graph)["Attention"] == 1
    assert dict(plan_session(step, "cpu", PlanOptions(scope="all")).applied)["sdpa"] == 1
    import ctypes

    assert ctypes.CDLL(str(library("cpu"))).MpgraphKernelsHaveSdpa() == 0


@pytest.mark.parametrize(("why", "model", "target"), [
    ("mask", lambda: _block((2, 2), mask=True), Target("cpu", "all")),
    ("softcap", lambda: _block((2, 2), softcap=5.0), Target("cpu", "all")),
    ("float32 on CUDA", lambda: _block((2, 2)), Target("cuda", "default", sdpa=True)),
])
def test_what_the_rule_leaves_alone(why: str, model, target: Target) -> None:
    step = build_training_graph(model(), optimizer=None)
    before = ir.to_proto(step).SerializeToString()
    assert RULE.apply(step, target) == 0, why
    assert ir.to_proto(step).SerializeToString() == before


def _assert_in_order(model: ir.Model) -> None:
    """Every node reads only graph inputs, initializers and values made before it."""
    seen = {*model.graph.inputs, *model.graph.initializers.values()}
    for node in model.graph:
        assert all(v is None or v in seen for v in node.inputs), node.name
        seen.update(node.outputs)


def _bf16_step(heads: tuple[int, int]) -> ir.Model:
    return mpgraph.convert(build_training_graph(_block(heads), optimizer="adamw"), "bf16", target="cuda")


def test_cuda_rewrite_of_a_bf16_step_graph() -> None:
    """Structure only (no GPU here): the bf16 step's Attention (head dim 8) and its backward
    become SdpaForward/SdpaBackward in bfloat16, the nodes stay in order, and every other
    node's recorded backward still resolves."""
    step = _bf16_step((2, 1))
    blocks = {n.name: sum(v is None for v in (*b.dys, *b.dxs)) for n, b in gradient_blocks(step.graph).items()}
    assert RULE.apply(step, Target("cuda", "default", sdpa=False)) == 0
    assert RULE.apply(step, Target("cuda", "default", sdpa=True)) == 1
    ops = _ops(step)
    assert ops["SdpaForward"] == ops["SdpaBackward"] == 1 and not {"Attention", "Softmax"} & set(ops)
    fused = {n.op_type: n for n in step.graph if n.domain == DOMAIN and n.op_type.startswith("Sdpa")}
    assert {v.dtype for v in fused["SdpaBackward"].inputs[:5]} == {ir.DataType.BFLOAT16}
    assert fused["SdpaForward"].outputs[1].dtype == ir.DataType.FLOAT is fused["SdpaBackward"].inputs[5].dtype
    assert fused["SdpaBackward"].inputs[5] is fused["SdpaForward"].outputs[1]
    _assert_in_order(step)
    after = {n.name: sum(v is None for v in (*b.dys, *b.dxs)) for n, b in gradient_blocks(step.graph).items()}
    assert after == {("attn/SdpaForward" if k == "attn" else k): v for k, v in blocks.items()}


def test_cuda_rewrite_needs_a_head_dim_multiple_of_8() -> None:
    step = _bf16_step((4, 2))  # head dim 4
    assert RULE.apply(step, Target("cuda", "default", sdpa=True)) == 0
    assert fuse_attention(step, "cpu") == 0  # bfloat16 is not the CPU kernels' type


def test_cuda_rewrite_casts_dy_and_the_gradients_to_the_recorded_types() -> None:
    """Where dY arrives in float32 (and a Cast of it to Y's type exists) and an input's recorded
    gradient is float32, the fused backward reads that Cast and a new Cast hands the float32
    gradient (name and readers) on."""
    from mpgraph._ir import meta as md

    step = _bf16_step((2, 1))
    attn = next(n for n in step.graph if n.op_type == "Attention")
    block = gradient_blocks(step.graph)[attn]
    dy, dq = block.dys[0], block.dxs[0]
    dy_readers, dq_readers = [(u.node, u.idx) for u in dy.uses()], [(u.node, u.idx) for u in dq.uses()]
    up = ir.node("Cast", [dy], {"to": ir.DataType.FLOAT}, name="dy32")
    up.outputs[0].name, up.outputs[0].dtype = "dy32", ir.DataType.FLOAT
    down = ir.node("Cast", [up.outputs[0]], {"to": ir.DataType.BFLOAT16}, name="dy16")
    down.outputs[0].name, down.outputs[0].dtype = "dy16", ir.DataType.BFLOAT16
    wide = ir.node("Cast", [dq], {"to": ir.DataType.FLOAT}, name="dq32")
    wide.outputs[0].name, wide.outputs[0].dtype = "dq32", ir.DataType.FLOAT
    for node, idx in dy_readers:
        node.replace_input_with(idx, down.outputs[0])
    step.graph.insert_after(dy.producer(), [up, down])
    step.graph.insert_after(dq.producer(), wide)
    for node, idx in dq_readers:
        node.replace_input_with(idx, wide.outputs[0])
    attn.metadata_props[md.NODE_GRAD_OUTPUTS] = '["dy32"]'
    attn.metadata_props[md.NODE_GRAD_INPUTS] = attn.metadata_props[md.NODE_GRAD_INPUTS].replace(dq.name, "dq32")
    assert RULE.apply(step, Target("cuda", "default", sdpa=True)) == 1
    backward = next(n for n in step.graph if n.op_type == "SdpaBackward")
    assert backward.inputs[4] is down.outputs[0] and up.inputs[0] is dy  # the existing Cast, not a second one
    handed = next(v for n in step.graph for v in n.outputs if v.name == "dq32")
    assert handed.dtype == ir.DataType.FLOAT and handed.producer().op_type == "Cast"
    assert handed.producer().inputs[0] is backward.outputs[0] and handed.uses()
    _assert_in_order(step)


def test_a_new_dy_cast_goes_after_dy() -> None:
    """Where dY arrives in float32 and no Cast of it to Y's type exists, the new Cast (and the
    fused backward) go after dY's producer, not after the forward (the order once broken here)."""
    from mpgraph._ir import meta as md

    step = _bf16_step((2, 1))
    attn = next(n for n in step.graph if n.op_type == "Attention")
    dy = gradient_blocks(step.graph)[attn].dys[0]
    up = ir.node("Cast", [dy], {"to": ir.DataType.FLOAT}, name="dy32")
    up.outputs[0].name, up.outputs[0].dtype = "dy32", ir.DataType.FLOAT
    step.graph.insert_after(dy.producer(), [up])
    attn.metadata_props[md.NODE_GRAD_OUTPUTS] = '["dy32"]'
    assert RULE.apply(step, Target("cuda", "default", sdpa=True)) == 1
    backward = next(n for n in step.graph if n.op_type == "SdpaBackward")
    cast = backward.inputs[4].producer()
    assert cast.op_type == "Cast" and cast.inputs[0] is up.outputs[0] and cast is not up
    _assert_in_order(step)
