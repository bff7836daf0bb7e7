"""float16 is safe by default: a range check on seeded random inputs, and a finite check.

``convert(model, "fp16")`` (and ``mpgraph convert --policy fp16``) runs the float32 model on
seeded random inputs that respect it, keeps float32 the ops whose values exceed float16's
range / 2, then runs the (emulated) result on the same inputs and keeps float32 the ops whose
outputs turn non-finite where float32's are finite. The issue's "done" models: the onnx wheel's
9 light models, the zoo, and a T5 whose feed-forward outputs overflow float16, all give finite
emulated outputs within 2e-3 of float32 with default flags, here on inputs of another seed
than the calibration's (measured worst, benchmarks/results/safe_fp16.txt: 8.1e-4 on the zoo's
wide MLP, 4.9e-4 on DenseNet-121, 6.5e-4 on the T5; the other light models' outputs are a
softmax of equal logits, so for them the finite check is what counts).
"""

from __future__ import annotations

import glob
import io
import json
import os
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.audit import compare
from mpgraph.data import random_feeds
from mpgraph.errors import MpgraphError
from mpgraph.runtime import probe
from mpgraph.runtime.probe import measure_ranges
from tests.helpers import mpgraph_cli, shared_range_checks

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT = sorted(glob.glob(os.path.join(LIGHT_DIR, "*.onnx")))
ZOO = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "models", "onnx", "*.onnx")))
#: Light models that convert in about a second; the rest run with --runslow.
FAST_LIGHT = ("light_squeezenet.onnx", "light_inception_v1.onnx")
#: Relative L2 error allowed against float32 (the issue's bound; measured worst 8.1e-4).
TOLERANCE = 2e-3


def _session(model: onnx.ModelProto | ir.Model) -> ort.InferenceSession:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = _session(model)
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    diff = np.linalg.norm(out.astype(np.float64) - ref.astype(np.float64))
    return float(diff / (np.linalg.norm(ref.astype(np.float64)) or 1.0))


def _check_default_fp16(path: str) -> float:
    """Default-flag fp16 emulation of ``path``: finite where float32 is, within TOLERANCE; worst error."""
    ref_model = onnx.load(path)
    feeds = random_feeds(ir.from_proto(ref_model), seed=1)  # not the calibration's seed 0
    ref = _run(ref_model, feeds)
    # The range check's float32 run is the one tests/pins.py and the alexnet test below make
    # too: measured once per process.
    with shared_range_checks():
        emulated = mpgraph.convert(path, "fp16", emulate=True)
    assert md.MODEL_CALIBRATION in emulated.metadata_props
    outs = _run(emulated, feeds)
    worst = 0.0
    for out, r in zip(outs, ref):
        if r.dtype.kind != "f":
            continue
        assert np.isfinite(out).all() or not np.isfinite(r).all(), f"{path}: non-finite output"
        worst = max(worst, _rel(out, r))
    assert worst <= TOLERANCE, f"{path}: relative error {worst:.3g} > {TOLERANCE}"
    return worst


@pytest.mark.parametrize("path", ZOO, ids=os.path.basename)
def test_zoo_fp16_default_is_finite_and_close(path: str) -> None:
    _check_default_fp16(path)


@pytest.mark.parametrize("path", [p for p in LIGHT if os.path.basename(p) in FAST_LIGHT], ids=os.path.basename)
def test_light_fp16_default_is_finite(path: str) -> None:
    _check_default_fp16(path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in LIGHT if os.path.basename(p) not in FAST_LIGHT], ids=os.path.basename)
def test_light_fp16_default_is_finite_slow(path: str) -> None:
    """VGG-19 and ZFNet take ~5-10 s each on 2 loaded cores."""
    _check_default_fp16(path)


def test_light_models_found() -> None:
    assert len(LIGHT) == 9 and len(ZOO) == 10


def test_opting_out_gives_the_overflow_back() -> None:
    """AlexNet's activations reach ~1e31: without the range check, float16 is NaN/inf."""
    path = os.path.join(LIGHT_DIR, "light_bvlc_alexnet.onnx")
    feeds = random_feeds(ir.from_proto(onnx.load(path)), seed=1)
    unchecked = mpgraph.convert(path, "fp16", emulate=True, calibrate=None)
    assert md.MODEL_CALIBRATION not in unchecked.metadata_props
    assert not all(np.isfinite(o).all() for o in _run(unchecked, feeds))
    with shared_range_checks():
        checked = mpgraph.convert(path, "fp16", emulate=True)
    summary = json.loads(checked.metadata_props[md.MODEL_CALIBRATION])
    assert summary["kept_float32"]["range"] >= 10 and summary["feeds"] == "random inputs, seed 0"
    assert all(np.isfinite(o).all() for o in _run(checked, feeds))


# --- T5 with overflowing feed-forward outputs -------------------------------------------------

#: Pretrained T5's DenseReluDense/wo outputs pass float16's range; random init does not, so the
#: wo weights are scaled by this (weights stay below 65504: max ~2.7e4; wo outputs reach ~2.8e5).
WO_SCALE = 1e5


def t5_overflowing() -> onnx.ModelProto:
    """A small T5 (2+2 layers, d_model 64) from a config, random init, wo weights scaled; logits out."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    class Logits(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits

    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("DenseReluDense.wo.weight"):
                param.mul_(WO_SCALE)
    ids, dec = torch.randint(1, 128, (2, 8)), torch.randint(1, 128, (2, 4))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(model), (ids, dec), buffer, dynamo=False, opset_version=18,
                          input_names=["input_ids", "decoder_input_ids"], output_names=["logits"])
    return onnx.load_from_string(buffer.getvalue())


@pytest.fixture(scope="module")
def t5() -> onnx.ModelProto:
    return t5_overflowing()


def test_t5_default_fp16_keeps_the_overflowing_matmuls(t5: onnx.ModelProto) -> None:
    feeds = random_feeds(ir.from_proto(t5), seed=1)
    ref = _run(t5, feeds)[0]
    assert np.isfinite(ref).all()
    unchecked = mpgraph.convert(onnx.load_from_string(t5.SerializeToString()), "fp16", emulate=True, calibrate=None)
    assert not np.isfinite(_run(unchecked, feeds)[0]).all()
    emulated = mpgraph.convert(onnx.load_from_string(t5.SerializeToString()), "fp16", emulate=True)
    wo = [n for n in emulated.graph if n.op_type == "MatMul" and "DenseReluDense/wo" in (n.name or "")]
    assert len(wo) == 4
    for node in wo:
        assert node.metadata_props[md.NODE_PRECISION] == "float32"
        assert node.metadata_props[md.NODE_REASON].startswith("calibration:")
    # The other MatMuls (attention, wi, lm_head) stay float16.
    assert sum(n.op_type == "MatMul" and n.metadata_props[md.NODE_PRECISION] == "float16" for n in emulated.graph) >= 20
    out = _run(emulated, feeds)[0]
    assert np.isfinite(out).all()
    assert _rel(out, ref) <= TOLERANCE  # measured 6.5e-4


# --- the finite check ----------------------------------------------------------------------------


def _flush_then_log() -> onnx.ModelProto:
    """``Log(Abs(x @ w))`` with w = 1e-9: float16 flushes w to zero, so Log gives -inf."""
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["y"], name="allow1"),
        h.make_node("Abs", ["y"], ["a"], name="infer1"),
        h.make_node("Log", ["a"], ["z"], name="deny1"),
    ]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 4])], [h.make_tensor_value_info("z", T.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.full((4, 3), 1e-9, np.float32), "w")],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])


@pytest.mark.parametrize("emulate", [True, False])
def test_finite_check_keeps_the_node_whose_output_turns_non_finite(emulate: bool) -> None:
    unchecked = mpgraph.convert(_flush_then_log(), "fp16", emulate=True, calibrate=None)
    feeds = random_feeds(unchecked, seed=0)
    assert np.isneginf(_run(unchecked, feeds)[0]).all()
    model = mpgraph.convert(_flush_then_log(), "fp16", emulate=emulate)
    precision = {n.name: n.metadata_props[md.NODE_PRECISION] for n in model.graph if n.name in ("allow1", "infer1")}
    # Log (float32) turns -inf from finite zeros: the nearest low producers stay float32.
    assert precision == {"allow1": "float32", "infer1": "float32"}
    assert "non-finite in float16" in model.graph.node("infer1").metadata_props[md.NODE_REASON]
    summary = json.loads(model.metadata_props[md.MODEL_CALIBRATION])
    assert summary["kept_float32"] == {"non-finite": 2}
    if emulate:
        assert np.isfinite(_run(model, feeds)[0]).all()


def test_range_check_reports_values_that_flush_to_zero() -> None:
    """``x @ w * 1e-4`` with w = 1e-4: the product is ~1e-8, below float16's 6e-8 subnormal."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="allow1"), h.make_node("Mul", ["y", "s"], ["z"], name="infer1")]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 4])], [h.make_tensor_value_info("z", T.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.full((4, 3), 1e-4, np.float32), "w"), numpy_helper.from_array(np.array(1e-4, np.float32), "s")],
    )
    model = mpgraph.convert(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]), "fp16", emulate=True)
    summary = json.loads(model.metadata_props[md.MODEL_CALIBRATION])
    assert summary["values_flushing"] >= 1
    name, share = summary["worst_flushing"][0]
    assert name == "z" and share > 0.5
    # compare names it: the output flushed to zero, an underflow.
    reference = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]))
    report = compare(reference, model)
    assert report.outputs[0].kind == "underflow" and report.outputs[0].flushed > 0


def _zoo_step(name: str) -> ir.Model:
    return mpgraph.build_training_graph(ZOO[[os.path.basename(p) for p in ZOO].index(name)], optimizer="adamw")


@pytest.mark.parametrize("emulate", [False, True])
def test_range_check_counts_only_values_the_conversion_lowers(emulate: bool) -> None:
    """Adam's second moment of small gradients sits below float16's subnormals in float32, but
    the step keeps optimizer state float32: nothing of it flushes, so no underflow is reported."""
    step = _zoo_step("tiny_mlp.loss.onnx")
    measured = measure_ranges(step, random_feeds(step, seed=0), ir.DataType.FLOAT16)
    assert any(name.startswith("optim/") for name, _ in measured.flushing())  # what was reported before
    model = mpgraph.convert(step, "fp16", emulate=emulate)
    summary = json.loads(model.metadata_props[md.MODEL_CALIBRATION])
    assert summary["values_flushing"] == 0 and summary["worst_flushing"] == []


def test_range_check_runs_on_a_step_graph_reduced_in_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large step graphs are range-checked by reductions inside the graph, Adam's float64 bias
    corrections among them (ORT refused the model, and the check was skipped)."""
    monkeypatch.setattr(probe, "MATERIALIZE_BYTES", 0)
    step = _zoo_step("tiny_mlp.loss.onnx")
    assert any(v.dtype == ir.DataType.DOUBLE for n in step.graph for v in n.outputs)
    model = mpgraph.convert(step, "fp16")
    assert md.MODEL_CALIBRATION in model.metadata_props


def test_compare_classifies_overflow_and_rounding() -> None:
    path = os.path.join(LIGHT_DIR, "light_squeezenet.onnx")
    overflowing = mpgraph.convert(path, "fp16", emulate=True, calibrate=None)
    report = compare(mpgraph.load_model(path), overflowing)
    assert report.first_divergence is not None and report.first_divergence.kind == "overflow"
    gpt = ZOO[[os.path.basename(p) for p in ZOO].index("gpt.onnx")]
    report = compare(mpgraph.load_model(gpt), mpgraph.convert(gpt, "fp16", emulate=True))
    kinds = {v.kind for v in report.values}
    assert "rounding" in kinds and "overflow" not in kinds


def test_native_fp16_on_cpu_says_it_computes_in_float32() -> None:
    gpt = ZOO[[os.path.basename(p) for p in ZOO].index("gpt.onnx")]
    report = compare(mpgraph.load_model(gpt), mpgraph.convert(gpt, "fp16"))
    assert any("computes native float16 ops in float32" in n and "--emulate" in n for n in report.notes)


# --- feeds -----------------------------------------------------------------------------------------


def test_random_feeds_respect_the_model() -> None:
    nodes = [
        h.make_node("Gather", ["table", "input_ids"], ["e"], name="embed"),
        h.make_node("Cast", ["attention_mask"], ["m"], to=T.FLOAT),
        h.make_node("Gather", ["classes", "seq_len"], ["l"], name="lens"),
        h.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"]),
    ]
    graph = h.make_graph(
        nodes, "g",
        [h.make_tensor_value_info("input_ids", T.INT64, ["batch", 8]),
         h.make_tensor_value_info("attention_mask", T.INT64, ["batch", 8]),
         h.make_tensor_value_info("seq_len", T.INT64, ["batch"]),
         h.make_tensor_value_info("scores", T.FLOAT, ["batch", 5]),
         h.make_tensor_value_info("labels", T.INT64, ["batch"])],
        [h.make_tensor_value_info(n, T.FLOAT, None) for n in ("e", "m", "l", "loss")],
        [numpy_helper.from_array(np.zeros((50, 4), np.float32), "table"),
         numpy_helper.from_array(np.zeros((9,), np.float32), "classes")],
    )
    feeds = random_feeds(ir.from_proto(h.make_model(graph)), seed=0, batch=64)
    ids = feeds["input_ids"]
    assert ids.shape == (64, 8) and ids.min() >= 0 and ids.max() < 50 and len(np.unique(ids)) > 10
    assert (feeds["attention_mask"] == 1).all()
    assert (feeds["seq_len"] >= 1).all()
    assert feeds["labels"].min() >= 0 and feeds["labels"].max() < 5 and len(np.unique(feeds["labels"])) > 1


def test_feeds_missing_an_input_name_the_keys_given(tmp_path) -> None:
    path = tmp_path / "inputs.npz"
    np.savez(path, tokens=np.zeros((2, 3), np.float32))
    with pytest.raises(MpgraphError, match=r"missing from the feeds; the feeds have 'tokens'; the model's inputs are \['x'\]"):
        mpgraph.convert(_flush_then_log(), "fp16", calibrate=str(path))


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_convert_fp16_prints_the_range_check(tmp_path) -> None:
    out = tmp_path / "sq.onnx"
    path = os.path.join(LIGHT_DIR, "light_squeezenet.onnx")
    result = mpgraph_cli("convert", path, "--policy", "fp16", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "range check on random inputs, seed 0:" in result.stdout and "ops kept float32" in result.stdout
    kept = json.loads(onnx.load(str(out)).metadata_props[[p.key for p in onnx.load(str(out)).metadata_props].index(md.MODEL_CALIBRATION)].value)
    assert kept["kept_float32"]["range"] > 0
    result = mpgraph_cli("convert", path, "--policy", "fp16", "--no-calibrate", "-o", str(tmp_path / "raw.onnx"))
    assert result.returncode == 0, result.stderr
    assert "no range check" in result.stdout
