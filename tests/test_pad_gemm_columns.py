"""PadGemmColumnsPass: unaligned weight-GEMM columns padded to a multiple of 64, same step."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph.training import build_training_graph, state_pairs
from mpgraph.training.pad_gemm_columns import MIN_COLUMNS, PadGemmColumnsPass
from tests.helpers import init, make_model, run_named, vi

VOCAB, WIDTH, BATCH, SEQ = 1030, 16, 2, 4  # 1030 = 16 * 64 + 6 columns: padded to 1088


def tied_lm(vocab: int = VOCAB):
    """A tied embedding's logits ``MatMul(e, Transpose(wte))`` (GPT-2 as both torch exporters
    write it) and a Linear head with bias ``Gemm(h, w, b, transB=1)`` (BERT's decoder), each with
    a cross-entropy loss."""
    rng = np.random.default_rng(0)
    nodes = [
        h.make_node("Gather", ["wte", "ids"], ["e"]),
        h.make_node("Transpose", ["wte"], ["wte_t"], perm=[1, 0]),
        h.make_node("MatMul", ["e", "wte_t"], ["logits"], name="lm_head"),
        h.make_node("Reshape", ["logits", "flat_shape"], ["flat"]),
        h.make_node("SoftmaxCrossEntropyLoss", ["flat", "labels"], ["loss1"], reduction="mean"),
        h.make_node("Reshape", ["e", "rows_shape"], ["rows"]),
        h.make_node("Tanh", ["rows"], ["hidden"]),
        h.make_node("Gemm", ["hidden", "w", "b"], ["scores"], name="decoder", transB=1),
        h.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss2"], reduction="mean"),
        h.make_node("Add", ["loss1", "loss2"], ["loss"]),
    ]
    inits = [init("wte", rng.standard_normal((vocab, WIDTH)).astype(np.float32)),
             init("w", rng.standard_normal((vocab, WIDTH)).astype(np.float32) * 0.3),
             init("b", rng.standard_normal(vocab).astype(np.float32)),
             init("flat_shape", np.array([-1, vocab], np.int64)), init("rows_shape", np.array([-1, WIDTH], np.int64))]
    inputs = [vi("ids", [BATCH, SEQ], T.INT64), vi("labels", [BATCH * SEQ], T.INT64)]
    return make_model(nodes, inputs, [vi("loss", [])], inits)


def _step(pad: bool) -> ir.Model:
    return build_training_graph(tied_lm(), optimizer="adamw", lr=1e-2, pad_gemms=pad)


def test_padded_gemms_are_aligned_and_the_parameters_keep_their_shapes():
    padded, plain = _step(True), _step(False)
    gemms = {n.name: n for n in padded.graph if n.op_type in ("MatMul", "Gemm") and n.name in ("lm_head", "decoder")}
    assert gemms["lm_head"].inputs[1].shape == ir.Shape([WIDTH, 1088])
    assert gemms["lm_head"].inputs[1].producer().op_type == "Transpose"  # the pad goes before it
    assert gemms["decoder"].inputs[1].shape == ir.Shape([1088, WIDTH])
    assert gemms["decoder"].inputs[2].shape == ir.Shape([1088])
    assert gemms["lm_head"].outputs[0].shape == ir.Shape([BATCH, SEQ, 1088])
    logits = next(v for n in padded.graph for v in n.outputs if v.name == "logits")
    assert logits.producer().op_type == "Slice" and logits.shape == ir.Shape([BATCH, SEQ, VOCAB])
    assert logits.producer().inputs[0] is gemms["lm_head"].outputs[0]
    inputs = {v.name: v.shape for v in padded.graph.inputs}
    assert state_pairs(padded) == state_pairs(plain)
    assert inputs["wte"] == ir.Shape([VOCAB, WIDTH]) and inputs["w"] == ir.Shape([VOCAB, WIDTH])
    # The backward GEMMs read the padded gradient: every GEMM over the vocabulary is aligned.
    for node in padded.graph:
        if node.op_type in ("MatMul", "Gemm"):
            for value in node.inputs:
                assert value is None or value.shape is None or VOCAB not in list(value.shape), node.name


def test_the_padded_step_updates_the_parameters_as_the_unpadded_one():
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int64),
             "labels": rng.integers(0, VOCAB, BATCH * SEQ, dtype=np.int64)}
    padded, plain = (run_named(_step(pad), feeds) for pad in (True, False))
    assert padded.keys() == plain.keys()
    for name, value in plain.items():
        assert padded[name].shape == value.shape, name
        np.testing.assert_allclose(padded[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # The step did move the tied embedding (a no-op step would pass the comparison above).
    updated = dict(state_pairs(_step(False)))["wte"]
    assert np.abs(plain[updated] - init_value("wte")).max() > 1e-3


def init_value(name: str) -> np.ndarray:
    from onnx import numpy_helper

    return next(numpy_helper.to_array(t) for t in tied_lm().graph.initializer if t.name == name)


@pytest.mark.parametrize("vocab", [1024 + 64, MIN_COLUMNS - 2, 1032])
def test_aligned_or_narrow_columns_are_left_alone(vocab):
    model = ir.from_proto(tied_lm(vocab))
    assert not PadGemmColumnsPass()(model).modified


def test_the_pass_is_idempotent():
    model = ir.from_proto(tied_lm())
    assert PadGemmColumnsPass()(model).modified
    assert not PadGemmColumnsPass()(model).modified


def linear_head(vocab: int = VOCAB):
    """BERT's masked-LM decoder as the dynamo exporter writes it: ``MatMul(h, Transpose(w)) + b``,
    then the cross-entropy over the rows."""
    rng = np.random.default_rng(2)
    nodes = [
        h.make_node("Gather", ["emb", "ids"], ["e"]),
        h.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
        h.make_node("MatMul", ["e", "w_t"], ["product"], name="decoder"),
        h.make_node("Add", ["b", "product"], ["scores"], name="decoder_bias"),
        h.make_node("Reshape", ["scores", "flat_shape"], ["flat"]),
        h.make_node("SoftmaxCrossEntropyLoss", ["flat", "labels"], ["loss"], reduction="mean"),
    ]
    inits = [init("emb", rng.standard_normal((vocab, WIDTH)).astype(np.float32)),
             init("w", rng.standard_normal((vocab, WIDTH)).astype(np.float32) * 0.3),
             init("b", rng.standard_normal(vocab).astype(np.float32)),
             init("flat_shape", np.array([-1, vocab], np.int64))]
    inputs = [vi("ids", [BATCH, SEQ], T.INT64), vi("labels", [BATCH * SEQ], T.INT64)]
    return make_model(nodes, inputs, [vi("loss", [])], inits)


def test_a_matmul_bias_add_pads_the_bias_and_slices_after_the_add():
    """Rule 3: the bias row gets the zero columns and one Slice follows the Add, under the
    Add's output name (no sliced copy of the product); the step matches the unpadded one."""
    padded, plain = (build_training_graph(linear_head(), optimizer="adamw", lr=1e-2, pad_gemms=pad) for pad in (True, False))
    (add,) = [n for n in padded.graph if n.name == "decoder_bias"]
    assert add.outputs[0].shape == ir.Shape([BATCH, SEQ, 1088]) and add.outputs[0].name != "scores"
    bias = next(v for v in add.inputs if v.shape == ir.Shape([1088]))
    assert bias.producer().op_type == "Pad" and bias.producer().inputs[0].name == "b"
    product = next(v for v in add.inputs if v is not bias)
    assert product.producer().name == "decoder" and product.shape == ir.Shape([BATCH, SEQ, 1088])
    scores = next(v for n in padded.graph for v in n.outputs if v.name == "scores")
    assert scores.producer().op_type == "Slice" and scores.producer().inputs[0] is add.outputs[0]
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int64),
             "labels": rng.integers(0, VOCAB, BATCH * SEQ, dtype=np.int64)}
    got, want = run_named(padded, feeds), run_named(plain, feeds)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    from onnx import numpy_helper

    start = next(numpy_helper.to_array(t) for t in linear_head().graph.initializer if t.name == "b")
    assert np.abs(want[dict(state_pairs(plain))["b"]] - start).max() > 1e-3  # the step moved the bias


def test_a_bias_add_the_product_shares_keeps_the_slice_after_the_gemm():
    """The product read by a second node, or added to something that is no bias row, keeps rule 2."""
    import onnx

    model = ir.from_proto(onnx.shape_inference.infer_shapes(linear_head()))
    (matmul,) = [n for n in model.graph if n.name == "decoder"]
    twin = ir.node("Relu", [matmul.outputs[0]], name="second_reader")
    model.graph.insert_after(matmul, twin)
    assert PadGemmColumnsPass()(model).modified
    (add,) = [n for n in model.graph if n.name == "decoder_bias"]
    assert add.inputs[0].name == "b" and add.inputs[1].producer().op_type == "Slice"
