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
