"""A transformer block written in the canonical ops (RMSNormalization, RotaryEmbedding, GQA
``Attention``, Gelu) trains: ``build_training_graph`` builds its step graph at opsets 23 and 24
and the gradients match torch's; what the Attention rule does not differentiate (the KV cache,
the extra outputs) is refused with the node named.

The per-op checks (finite differences, every variant) are rows of ``test_gradients.py``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpgraph.errors import GradientError
from mpgraph.training import build_training_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional

B, T, D, HQ, HKV = 2, 6, 16, 4, 2
HEAD = D // HQ


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    theta = np.arange(T)[:, None] / 10000.0 ** (np.arange(HEAD // 2) / (HEAD // 2))
    return {
        "norm.weight": 1.0 + 0.1 * rng.standard_normal(D), "wq": rng.standard_normal((D, D)) / 4,
        "wk": rng.standard_normal((D, HKV * HEAD)) / 4, "wv": rng.standard_normal((D, HKV * HEAD)) / 4,
        "wo": rng.standard_normal((D, D)) / 4, "rope.cos": np.cos(theta), "rope.sin": np.sin(theta),
    }


def _block(opset: int, extra: tuple[str, ...] = (), past: bool = False) -> onnx.ModelProto:
    """``loss = mean(gelu(x + Attention(rope(q), rope(k), v) wo)^2)`` with ``q, k, v`` from
    ``rmsnorm(x)``: 3-D GQA attention (4 query heads, 2 kv heads), causal."""
    n = helper.make_node
    attention_inputs = ["qr", "kr", "v", "", "past_k", "past_v"] if past else ["qr", "kr", "v"]
    nodes = [
        n("RMSNormalization", ["x", "norm.weight"], ["h"], name="norm"),
        n("MatMul", ["h", "wq"], ["q"]), n("MatMul", ["h", "wk"], ["k"]), n("MatMul", ["h", "wv"], ["v"]),
        n("RotaryEmbedding", ["q", "rope.cos", "rope.sin", "positions"], ["qr"], num_heads=HQ, name="rope_q"),
        n("RotaryEmbedding", ["k", "rope.cos", "rope.sin", "positions"], ["kr"], num_heads=HKV, name="rope_k"),
        n("Attention", attention_inputs, ["a", *extra], name="attn", is_causal=1, q_num_heads=HQ, kv_num_heads=HKV),
        n("MatMul", ["a", "wo"], ["o"]), n("Add", ["x", "o"], ["r"]), n("Gelu", ["r"], ["g"], approximate="tanh"),
        n("Mul", ["g", "g"], ["sq"]), n("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    if extra:  # the loss also reads the extra output
        nodes[-1:] = [n("ReduceMean", ["sq"], ["l0"], keepdims=0), n("ReduceMean", [extra[-1]], ["l1"], keepdims=0),
                      n("Add", ["l0", "l1"], ["loss"])]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in _params().items()]
    inits.append(numpy_helper.from_array(np.tile(np.arange(T, dtype=np.int64), (B, 1)), "positions"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, D])]
    if past:
        inputs += [helper.make_tensor_value_info(f"past_{c}", TensorProto.FLOAT, [B, HKV, 3, HEAD]) for c in "kv"]
    graph = helper.make_graph(nodes, "block", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _torch_block(x: np.ndarray, p: dict) -> object:
    def rope(t, heads):
        t = t.reshape(B, T, heads, HEAD)
        c, s = p["rope.cos"][:, None], p["rope.sin"][:, None]
        t1, t2 = t.chunk(2, -1)
        return torch.cat((c * t1 - s * t2, s * t1 + c * t2), -1).transpose(1, 2)

    xt = torch.tensor(x, dtype=torch.float64)
    h = F.rms_norm(xt, (D,), p["norm.weight"], eps=1e-5)
    q, k = rope(h @ p["wq"], HQ), rope(h @ p["wk"], HKV)
    v = (h @ p["wv"]).reshape(B, T, HKV, HEAD).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(B, T, D)
    g = F.gelu(xt + a @ p["wo"], approximate="tanh")
    return (g * g).mean()


@pytest.mark.parametrize("opset", [23, 24])
def test_transformer_block_gradients_match_torch(opset: int) -> None:
    step = build_training_graph(_block(opset), optimizer=None, freeze=["rope.*"])
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    got = _run(step, x)
    assert not {"grad/rope.cos", "grad/rope.sin"} & set(got)
    params = {k: torch.tensor(v.astype(np.float32).astype(np.float64), requires_grad=not k.startswith("rope"))
              for k, v in _params().items()}
    _torch_block(x, params).backward()
    trained = [k for k in params if not k.startswith("rope")]
    scale = max(float(params[k].grad.norm()) for k in trained)
    for k in trained:
        err = np.linalg.norm(got[f"grad/{k}"] - params[k].grad.numpy()) / scale
        assert err < 1e-5, (k, err)


def test_attention_kv_cache_is_refused_with_the_node_named() -> None:
    with pytest.raises(GradientError, match="Attention node 'attn': input past_key is a KV cache"):
        build_training_graph(_block(23, extra=("present_k", "present_v"), past=True), optimizer=None, freeze=["rope.*"])


def test_attention_extra_output_in_the_loss_is_refused() -> None:
    with pytest.raises(GradientError, match="Attention node 'attn': output qk_matmul_output feeds the loss"):
        build_training_graph(_block(23, extra=("", "", "scores")), optimizer=None, freeze=["rope.*"])


def test_attention_lowers_v_and_a_float_mask_with_q_and_k() -> None:
    """Attention's schema types V (``T2``) and a float mask (``U``) apart from Q and K (``T1``),
    but its function body and ORT's kernels bind them to one type: they are lowered together."""
    from mpgraph.optypes import node_typing

    def typing(mask_dtype: ir.DataType) -> list[int]:
        values = [ir.Value(name=n, type=ir.TensorType(d)) for n, d in
                  (("q", ir.DataType.FLOAT), ("k", ir.DataType.FLOAT), ("v", ir.DataType.FLOAT), ("m", mask_dtype))]
        node = ir.Node("", "Attention", values)
        node.outputs[0].dtype = ir.DataType.FLOAT
        return node_typing(node, {"": 23}).compute_inputs()

    assert typing(ir.DataType.FLOAT) == [0, 1, 2, 3]
    assert typing(ir.DataType.BOOL) == [0, 1, 2]


@pytest.mark.parametrize(("preset", "emulate"), [("fp16", True), ("fp16", False), ("bf16", True), ("bf16", False)])
def test_transformer_step_converts_and_runs_on_cpu(preset: str, emulate: bool) -> None:
    """The AdamW step of the block converts under the fp16/bf16 presets (Attention and
    RotaryEmbedding run low, RMSNormalization stays float32) and runs on ORT CPU: natively,
    float16 Attention has a CPU kernel and takes V low too; bfloat16 has none there (probed at
    opset 23) and stays float32."""
    import mpgraph
    from mpgraph._ir import meta as md

    step = build_training_graph(_block(23), optimizer="adamw", freeze=["rope.*"])
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    want = _run(step, x)["loss"]
    model = mpgraph.convert(ir.from_proto(ir.to_proto(step)), preset, emulate=emulate, target="cpu")
    low = "float16" if preset == "fp16" else "bfloat16"
    precision = {n.name: n.metadata_props.get(md.NODE_PRECISION) for n in model.graph}
    expected = low if emulate or preset == "fp16" else "float32"
    assert (precision["attn"], precision["rope_q"], precision["norm"]) == (expected, expected, "float32")
    attn = next(n for n in model.graph if n.name == "attn")
    assert {v.dtype for v in attn.inputs if v is not None} == {ir.DataType.FLOAT if emulate or expected == "float32" else ir.DataType.FLOAT16}
    got = _run(model, x)["loss"]
    assert np.isfinite(got) and abs(got - want) <= 1e-2 * abs(want), (got, want)


def _run(model: ir.Model, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}), strict=True))
