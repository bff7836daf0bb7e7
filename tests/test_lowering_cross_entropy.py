"""The ``cross_entropy`` rule: a language-model loss head (``SoftmaxCrossEntropyLoss`` over a
GEMM's logits, through the policy's float32 Cast and ``PadGemmColumnsPass``'s Slice) and its
backward as ``SoftmaxCrossEntropyRows`` / ``SoftmaxCrossEntropyRowsGrad``.

On ORT CPU with the float32 reference kernels the lowered step equals the unlowered one within
float32 rounding (a hand-written padded head with ignored rows, mean and sum; the corpus GPT-2
and Llama, whose shifted labels end every row with -100); on a bf16 CUDA plan the float32
[rows, vocab] buffers, the Slice, the Pad and the Casts are gone; the kernels themselves ignore
and zero the padding columns. The CUDA kernels against the CPU ones: ``test_cuda_kernels_match_cpu``
(``gpu``). About 4 CPU-s without ``--runslow``, 10 with it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import mpgraph
from mpgraph import lowering
from mpgraph.lowering.cross_entropy import fuse_cross_entropy
from mpgraph.lowering.specialize import specialize_shapes
from mpgraph.training import build_training_graph
from tests.helpers import init, make_model, run_named, vi

VOCAB = 1030  # PadGemmColumnsPass pads it to 1088, as GPT-2's 50257 to 50304
PADDED = 1088
B, S, D = 2, 5, 8
HEAD_OPS = ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyGrad", "Slice", "Pad", "OneHot", "Exp")


def _head(reduction: str = "mean", ignore: bool = True, weights: bool = False) -> object:
    """``loss = SoftmaxCrossEntropyLoss(Reshape(MatMul(x, w), [-1, V]), Reshape(labels, [-1]))``."""
    rng = np.random.default_rng(0)
    attrs = {"reduction": reduction, **({"ignore_index": -100} if ignore else {})}
    sce_inputs = ["rows", "lab"] + (["cw"] if weights else [])
    nodes = [h.make_node("MatMul", ["x", "w"], ["logits"]), h.make_node("Reshape", ["logits", "flat"], ["rows"]),
             h.make_node("Reshape", ["labels", "flat1"], ["lab"]),
             h.make_node("SoftmaxCrossEntropyLoss", sce_inputs, ["loss"], **attrs)]
    inits = [init("w", (rng.standard_normal((D, VOCAB)) * 0.5).astype(np.float32)),
             init("flat", np.array([-1, VOCAB], np.int64)), init("flat1", np.array([-1], np.int64))]
    if weights:
        inits.append(init("cw", np.linspace(0.5, 1.5, VOCAB).astype(np.float32)))
    return make_model(nodes, [vi("x", [B, S, D]), vi("labels", [B, S], T.INT64)], [vi("loss", [])], inits)


def _feeds(ignored: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, VOCAB, (B, S)).astype(np.int64)
    labels[:, -1] = VOCAB - 1  # the last real column, next to the padding
    if ignored:
        labels[0, 1] = labels[1, 3] = -100
    return {"x": rng.standard_normal((B, S, D)).astype(np.float32), "labels": labels}


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: float) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        scale = max(float(np.max(np.abs(value))), 1e-6) if value.size else 1.0
        np.testing.assert_allclose(got[name], value, rtol=0, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize(("reduction", "ignore"), [("mean", True), ("sum", True), ("mean", False)])
def test_padded_head_lowered_equals_unlowered_on_cpu(reduction, ignore):
    step = build_training_graph(_head(reduction, ignore), optimizer=None, pad_gemms=True)
    assert Counter(n.op_type for n in step.graph)["Slice"] == 2  # the logits' columns and w's gradient
    low = _copy(step)
    assert lowering.lower(low, "cpu", "all") >= 1
    ops = Counter(n.op_type for n in low.graph)
    assert ops["SoftmaxCrossEntropyRows"] == ops["SoftmaxCrossEntropyRowsGrad"] == 1
    assert not any(ops[op] for op in ("SoftmaxCrossEntropyLoss", "OneHot", "Exp"))
    assert ops["Pad"] == 1 and ops["Slice"] == 1  # w's zero columns and its gradient's Slice stay
    grad = next(n for n in low.graph if n.op_type == "SoftmaxCrossEntropyRowsGrad")
    assert grad.outputs[0].shape == ir.Shape([B, S, PADDED]) and grad.attributes.get_int("valid_cols") == VOCAB
    feeds = _feeds(ignored=ignore)
    _assert_close(run_named(low, feeds, library=True), run_named(step, feeds), 1e-6)
    assert fuse_cross_entropy(low, "cpu") == 0  # lowered twice: nothing left to match


@pytest.mark.slow
@pytest.mark.parametrize(("case", "exporter"), [("gpt2", "torchscript"), ("llama", "dynamo")])
def test_causal_lm_steps_lowered_equal_unlowered_on_cpu(case, exporter):
    """HF's ForCausalLMLoss pads the labels with -100 before shifting them: every sequence's
    last row is ignored, and the mean is over the others."""
    pytest.importorskip("transformers")
    from tests.corpus import cache

    step = build_training_graph(cache.exported(case, exporter).model, optimizer=None)
    sce = next(n for n in step.graph if n.op_type == "SoftmaxCrossEntropyLoss")
    assert sce.attributes.get_int("ignore_index") == -100
    low = _copy(step)
    lowering.lower(low, "cpu", "all")
    assert Counter(n.op_type for n in low.graph)["SoftmaxCrossEntropyRows"] == 1
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (2, 8)).astype(np.int64)
    feeds = {v.name: ids for v in step.graph.inputs if v.const_value is None}
    _assert_close(run_named(low, feeds, library=True), run_named(step, feeds), 2e-6)


def _bf16_cuda_plan(policy: str = "bf16") -> ir.Model:
    step = build_training_graph(_head(), optimizer="adamw", target="cuda")
    converted = mpgraph.convert(step, policy, target="cuda", calibrate=None, validate=False)
    model = specialize_shapes(converted, {"x": (B, S, D), "labels": (B, S)})
    lowering.lower(model, "cuda", "default")
    return model


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_cuda_plan_keeps_no_float32_logits(policy):
    """No float32 tensor of the logits' size is left, nor the Slice/Pad copies and their
    Casts; the gradient is written in the GEMM's dtype and read by the backward GEMMs as is.
    fp16's loss scale reaches the kernel as the loss's incoming gradient (the scaled seed)."""
    model = _bf16_cuda_plan(policy)
    ops = Counter(n.op_type for n in model.graph)
    assert ops["SoftmaxCrossEntropyRows"] == ops["SoftmaxCrossEntropyRowsGrad"] == 1
    assert not any(ops[op] for op in HEAD_OPS if op not in ("Slice", "Pad"))
    big = [v.name for n in model.graph for v in n.outputs
           if v.dtype == ir.DataType.FLOAT and v.shape is not None and v.shape.is_static() and np.prod(v.shape.dims) >= B * S * VOCAB]
    assert big == []
    grad = next(n for n in model.graph if n.op_type == "SoftmaxCrossEntropyRowsGrad")
    low = ir.DataType.BFLOAT16 if policy == "bf16" else ir.DataType.FLOAT16
    assert grad.outputs[0].dtype == low and list(grad.outputs[0].shape) == [B, S, PADDED]
    assert {u.node.op_type for u in grad.outputs[0].uses()} <= {"Flatten", "Gemm", "FusedMatMul", "MatMul"}
    seed = model.metadata_props["mpgraph.grad_seed"]
    if policy == "bf16":
        assert grad.inputs[4].name == seed
    else:  # ScaleLossPass's seed * loss_scale, which the gradient block (recorded before it) does not name
        scaled = grad.inputs[4].producer()
        assert scaled is not None and scaled.op_type == "Mul" and seed in [v.name for v in scaled.inputs]


def test_a_scaled_loss_reaches_the_kernel_scaled():
    """Loss scaling multiplies the seed after autodiff recorded it (``seed * loss_scale`` for
    every reader): the fused backward must read the product, or every gradient comes out
    ``loss_scale`` times too small after the unscale (0.2% off in w here, m 1024x)."""
    from mpgraph.passes.scale_loss import ScaleLossPass
    from mpgraph.policy.schema import LossScaling

    step = build_training_graph(_head(), optimizer="adamw", pad_gemms=True)
    ScaleLossPass(LossScaling(mode="dynamic", init=1024.0))(step)
    low = _copy(step)
    assert fuse_cross_entropy(low, "cpu") == 1
    feeds = _feeds()  # the state (w, AdamW's moments, loss_scale = 1024) keeps its initial values
    got, want = run_named(low, feeds, library=True), run_named(step, feeds)
    _assert_close({k: v.astype(np.float32) for k, v in got.items()}, {k: v.astype(np.float32) for k, v in want.items()},
                  2e-6)


def test_left_alone_with_class_weights_or_a_read_log_prob():
    weighted = build_training_graph(_head(weights=True), optimizer=None, pad_gemms=True)
    assert fuse_cross_entropy(weighted, "cpu") == 0
    step = build_training_graph(_head(), optimizer=None, pad_gemms=True)
    sce = next(n for n in step.graph if n.op_type == "SoftmaxCrossEntropyLoss")
    step.graph.outputs.append(sce.outputs[1])  # log_prob read outside the backward
    assert fuse_cross_entropy(step, "cpu") == 0


# -- the kernels ----------------------------------------------------------------------------


def _kernel_graph(cols: int, valid: int, rows: int, reduction: int, dtype: int = T.FLOAT) -> ir.Model:
    """Both ops on float32 inputs (cast to ``dtype`` inside the graph), outputs in float32."""
    attrs = {"valid_cols": valid, "ignore_index": -100, "reduction": reduction}
    low = "xl" if dtype != T.FLOAT else "x"
    nodes = [h.make_node("Cast", ["x"], ["xl"], to=dtype)] if dtype != T.FLOAT else []
    nodes += [h.make_node("SoftmaxCrossEntropyRows", [low, "labels"], ["loss", "stats", "count"], domain="ai.mpgraph", **attrs),
              h.make_node("SoftmaxCrossEntropyRowsGrad", [low, "labels", "stats", "count", "dloss"], ["dxl"],
                          domain="ai.mpgraph", **attrs),
              h.make_node("Cast", ["dxl"], ["dx"], to=T.FLOAT)]
    dloss_shape = [rows] if reduction == 2 else []
    model = make_model(nodes, [vi("x", [rows, cols]), vi("labels", [rows], T.INT64), vi("dloss", dloss_shape)],
                       [vi("loss", None), vi("stats", None), vi("dx", None)])
    model.opset_import.append(h.make_opsetid("ai.mpgraph", 1))
    return ir.from_proto(model)


def _reference(x, labels, valid, dloss, reduction):
    """The unfused ops' math in float64 over the valid columns; zeros in the padding."""
    v = x[:, :valid].astype(np.float64)
    lse = np.log(np.exp(v - v.max(1, keepdims=True)).sum(1)) + v.max(1)
    kept = labels != -100
    safe = np.where(kept, labels, 0)
    terms = np.where(kept, lse - v[np.arange(len(v)), safe], 0.0)
    count = kept.sum()
    loss = terms.sum() / count if reduction == 0 else terms.sum() if reduction == 1 else terms
    scale = (dloss / count if reduction == 0 else dloss if reduction == 1 else dloss) * kept
    d = np.zeros_like(x, dtype=np.float64)
    d[:, :valid] = (np.exp(v - lse[:, None]) - np.eye(valid)[safe]) * np.reshape(scale, (-1, 1))
    return loss, d


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_kernels_ignore_and_zero_the_padding_columns(reduction):
    """The padding holds large logits: taken into the max or the sum they would change the loss,
    and the gradient formula there is not zero; a kernel that left those columns unwritten or
    computed them as classes fails. A loss scale (512) comes in as dloss."""
    rows, cols, valid = 6, 24, 19
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 3
    x[:, valid:] = 200.0
    labels = np.array([0, 18, -100, 5, 7, -100], np.int64)
    dloss = (512 * (1 + rng.random(rows))).astype(np.float32) if reduction == 2 else np.array(512.0, np.float32)
    got = run_named(_kernel_graph(cols, valid, rows, reduction), {"x": x, "labels": labels, "dloss": dloss}, library=True)
    loss, d = _reference(x, labels, valid, dloss.astype(np.float64), reduction)
    np.testing.assert_allclose(got["loss"], loss, rtol=2e-6, atol=1e-6)
    assert np.all(got["dx"][:, valid:] == 0)
    np.testing.assert_allclose(got["dx"], d, rtol=0, atol=2e-6 * np.abs(d).max())
    np.testing.assert_array_equal(got["dx"][[2, 5]], 0)  # ignored rows


def test_kernels_on_an_empty_batch():
    """No rows: count 0 and the mean 0 / 0, NaN (what ORT's op gives when every row is ignored;
    ORT's CPU op refuses an empty batch in its own Reshape), an empty gradient."""
    got = run_named(_kernel_graph(8, 5, 0, 0), {"x": np.zeros((0, 8), np.float32), "labels": np.zeros(0, np.int64),
                                                   "dloss": np.array(1.0, np.float32)}, library=True)
    assert np.isnan(got["loss"]) and got["stats"].shape == (0, 2) and got["dx"].shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [T.BFLOAT16, T.FLOAT16, T.FLOAT])
@pytest.mark.parametrize(("cols", "valid"), [(1088, 1030), (1030, 1030), (1031, 1030)])
def test_cuda_kernels_match_cpu(dtype, cols, valid):
    """The CUDA kernels (16-byte loads where a row allows: cols a multiple of 8; scalar
    otherwise) against the CPU float32 ones on the same low-precision values: the loss and the
    statistics within float32 rounding of the sums, dx within one ulp of its type."""
    import ml_dtypes
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    rows = 300
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((rows, cols)) * 4).astype(np.float32)
    np_type = {T.BFLOAT16: ml_dtypes.bfloat16, T.FLOAT16: np.float16, T.FLOAT: np.float32}[dtype]
    x = x.astype(np_type).astype(np.float32)
    labels = rng.integers(0, valid, rows).astype(np.int64)
    labels[::7] = -100
    feeds = {"x": x, "labels": labels, "dloss": np.array(1.0, np.float32)}
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(lowering.library("cuda")))
    graph = ir.to_proto(_kernel_graph(cols, valid, rows, 0, dtype)).SerializeToString()
    session = ort.InferenceSession(graph, options, providers=["CUDAExecutionProvider"])
    cuda = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    cpu = run_named(_kernel_graph(cols, valid, rows, 0), feeds, library=True)
    np.testing.assert_allclose(cuda["loss"], cpu["loss"], rtol=1e-5)
    np.testing.assert_allclose(cuda["stats"], cpu["stats"], rtol=1e-5, atol=1e-5)
    # One ulp of the type relative to the value is at most 2^-7 (bfloat16), 2^-10 (float16);
    # float32: CUDA's expf against glibc's and another order of the sums. atol: float16's subnormals.
    rtol, atol = {T.BFLOAT16: (2.0 ** -7, 0.0), T.FLOAT16: (2.0 ** -10, 2.0 ** -24), T.FLOAT: (1e-5, 1e-30)}[dtype]
    want = cpu["dx"].astype(np_type).astype(np.float32)
    np.testing.assert_allclose(cuda["dx"], want, rtol=rtol, atol=atol)
    assert np.all(cuda["dx"][:, valid:] == 0)
