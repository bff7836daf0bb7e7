"""Conversion tables over real models: every preset on every model ONNX Runtime (CPU) can run.

Models: the onnx wheel's ``backend/test/data/light/*.onnx`` (AlexNet, DenseNet-121, Inception
v1/v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512), its
``pytorch-converted/*/model.onnx`` (single-module exports, mostly opset 6) and the committed zoo
``models/onnx/*.onnx``; times every preset of ``mpgraph.policy.list_presets()``.

Per (model, preset):
    (a) the native conversion passes the checker (full) and strict shape inference with type
        checks, asserted again here on ``ir.to_proto`` of the result;
    (b) the emulated conversion runs in ORT CPU, with no NaN/inf, within ``REL_L2_TOL`` of the
        float32 model's ORT outputs;
    (c) float16 native models also run in ORT CPU (within the same tolerance); bfloat16 native
        models are only checked for validity (ORT CPU has no bfloat16 compute kernels);
    (d) the ``fp32`` preset reproduces the input model's outputs bit for bit;
    (e) converting the result again with the same policy changes no byte of the proto;
    (f) no Cast reads a Cast whose cast was lossless (a chain that should have folded) and no
        tensor is cast twice to one dtype;
    (g) the audit's ``casts_inserted`` counts exactly the Casts mpgraph added.

The light models hold constant 0.02 weights: their float32 activations reach ~1e31, far beyond
float16's 65504, so float16 presets convert them with ``calibrate=`` the same inputs (ops whose
activations overflow stay float32); ``test_alexnet_fp16_needs_calibration`` shows that without
calibration the float16 emulation of AlexNet produces NaN/inf. Their outputs are a softmax over
1000 equal logits (0.001 everywhere), so (b) is a weak check on them; the pytorch-converted and
zoo models carry the numerical signal.

Models that ORT CPU cannot run in float32 (opset-6 kernels ORT dropped: AveragePool-1,
BatchNormalization-6, Gemm-6, Mul/Add-6 with broadcast attributes, PRelu-6) are skipped with
ORT's message; ``test_ort_unrunnable_models`` pins that list (23 of 83 pytorch-converted).

Coverage: every runnable model times every preset, except torch-autocast and tf-amp on the light
models, which run on three of them (``LIGHT_PARITY_SUBSET``); see the timing note there.
"""

from __future__ import annotations

import functools
import glob
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from onnx import numpy_helper

from mpgraph import metadata as md
from mpgraph.audit.report import audit
from mpgraph.convert import convert
from mpgraph.dtypes import is_float, is_lossless
from mpgraph.policy import list_presets, load_policy

# Relative L2 error ||y - y_fp32|| / ||y_fp32|| allowed per low dtype, for every output.
# Measured on this table (ORT 1.32 CPU), max over models, presets and outputs:
#   float16 (fp16, torch-autocast, tf-amp): emulated 6.8e-4 (zoo/resnet.loss logits),
#            native 4.4e-4 (pytorch/Conv1d_pad1size1)
#   bfloat16: emulated 4.5e-3 (zoo/resnet.loss logits)
# The limits leave about 3x (fp16) and 4x (bf16) headroom. test_error_summary prints the
# current maxima (pytest -s).
REL_L2_TOL = {
    ir.DataType.FLOAT16: 2e-3,
    ir.DataType.BFLOAT16: 2e-2,
}

ONNX_DATA = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data"
ROOT = Path(__file__).resolve().parent.parent
# tf32 builds the same graph as fp32 (it only sets the runtime's TF32 flag): tests/test_policy.py
# checks that once instead of per model.
PRESETS = [p for p in list_presets() if p != "tf32"]
BATCH = 2
SEED = 0


def _model_paths() -> dict[str, Path]:
    paths = {}
    for p in sorted(glob.glob(str(ONNX_DATA / "light" / "*.onnx"))):
        paths[f"light/{Path(p).stem.removeprefix('light_')}"] = Path(p)
    for p in sorted(glob.glob(str(ONNX_DATA / "pytorch-converted" / "*" / "model.onnx"))):
        paths[f"pytorch/{Path(p).parent.name.removeprefix('test_')}"] = Path(p)
    for p in sorted(glob.glob(str(ROOT / "models" / "onnx" / "*.onnx"))):
        paths[f"zoo/{Path(p).name.removesuffix('.onnx')}"] = Path(p)
    return paths


MODELS = _model_paths()

# ORT 1.32 CPU has no kernel for these old-opset nodes; pinned so a change shows up.
ORT_UNRUNNABLE = {
    *(
        f"pytorch/{n}"
        for n in ("AvgPool1d", "AvgPool1d_stride", "AvgPool2d", "AvgPool2d_stride", "AvgPool3d")
    ),
    *(f"pytorch/{n}" for n in ("AvgPool3d_stride", "AvgPool3d_stride1_pad0_gpu_input")),
    *(
        f"pytorch/BatchNorm{n}"
        for n in ("1d_3d_input_eval", "2d_eval", "2d_momentum_eval", "3d_eval", "3d_momentum_eval")
    ),
    *(
        f"pytorch/{n}"
        for n in ("GLU", "GLU_dim", "Linear", "PoissonNLLLLoss_no_reduce", "Softsign")
    ),
    *(
        f"pytorch/PReLU_{n}"
        for n in ("1d", "1d_multiparam", "2d", "2d_multiparam", "3d", "3d_multiparam")
    ),
}


@functools.cache
def model_bytes(name: str) -> bytes:
    return MODELS[name].read_bytes()


def fresh_proto(name: str) -> onnx.ModelProto:
    return onnx.load_from_string(model_bytes(name))


def session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # zoo parameters are inputs with initializers: by design
    options.intra_op_num_threads = 2
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _real_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initialized = {t.name for t in proto.graph.initializer}
    return [v for v in proto.graph.input if v.name not in initialized]


@functools.cache
def feeds(name: str) -> dict[str, np.ndarray]:
    """The model's non-initializer inputs: stored test data, else seeded random."""
    proto = fresh_proto(name)
    inputs = _real_inputs(proto)
    stored = sorted(MODELS[name].parent.glob("test_data_set_0/input_*.pb"))
    if name.startswith("pytorch/") and stored:
        return {
            v.name: numpy_helper.to_array(onnx.load_tensor(str(p))) for v, p in zip(inputs, stored)
        }
    rng = np.random.default_rng(SEED)
    # Integer inputs are class labels or gpt tokens: both index the last axis of `logits`
    # (gpt's vocabulary, models/zoo.py GPT_VOCAB, or the classes).
    logits = [o for o in proto.graph.output if o.name == "logits"]
    bound = logits[0].type.tensor_type.shape.dim[-1].dim_value if logits else 1
    out = {}
    for v in inputs:
        tt = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else BATCH for d in tt.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            out[v.name] = rng.standard_normal(shape).astype(dtype)
        else:
            out[v.name] = rng.integers(0, bound, shape).astype(dtype)
    return out


@functools.cache
def reference(name: str) -> list[np.ndarray] | str:
    """Float32 outputs of the input model in ORT CPU, or why ORT cannot run it."""
    try:
        return session(model_bytes(name)).run(None, feeds(name))
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        return str(e).strip().splitlines()[0]


def reference_or_skip(name: str) -> list[np.ndarray]:
    ref = reference(name)
    if isinstance(ref, str):
        pytest.skip(f"ORT CPU cannot run the float32 model: {ref}")
    return ref


def low_dtype(preset: str) -> ir.DataType:
    return load_policy(preset).dtype


def calibration(name: str, preset: str) -> dict[str, np.ndarray] | None:
    # The light models' activations overflow float16 (see the module docstring).
    return (
        feeds(name)
        if name.startswith("light/") and low_dtype(preset) == ir.DataType.FLOAT16
        else None
    )


@functools.cache
def converted(name: str, preset: str, emulate: bool) -> tuple[bytes, ir.Model]:
    model = convert(fresh_proto(name), preset, emulate=emulate, calibrate=calibration(name, preset))
    return ir.to_proto(model).SerializeToString(), model


def run_converted(data: bytes, name: str) -> list[np.ndarray]:
    sess = session(data)
    given = feeds(name)
    typed = {}
    for i in sess.get_inputs():
        # keep_io_types is on in every preset; cast anyway should a policy lower an input.
        np_type = {"tensor(float16)": np.float16, "tensor(float)": np.float32}.get(i.type)
        typed[i.name] = given[i.name].astype(np_type) if np_type is not None else given[i.name]
    return sess.run(None, typed)


def rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref64)
    return (
        float(np.linalg.norm(out64 - ref64) / denom) if denom > 0 else float(np.linalg.norm(out64))
    )


#: preset, "emulated"/"native" -> worst relative L2 error seen (printed by test_error_summary).
MEASURED: dict[tuple[str, str], tuple[float, str]] = {}


def check_close(
    outs: list[np.ndarray], ref: list[np.ndarray], name: str, preset: str, kind: str
) -> None:
    tol = REL_L2_TOL[low_dtype(preset)]
    assert len(outs) == len(ref)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.shape == r.shape, f"output {i}: shape {out.shape} != {r.shape}"
        if np.issubdtype(r.dtype, np.floating):
            assert np.isfinite(out).all() or not np.isfinite(r).all(), f"output {i} has NaN/inf"
            err = rel_l2(out, r)
            if err > MEASURED.get((preset, kind), (-1.0, ""))[0]:
                MEASURED[(preset, kind)] = (err, f"{name} output {i}")
            assert err <= tol, f"output {i}: relative L2 error {err:.3g} > {tol:g}"
        else:
            assert np.array_equal(out, r), f"output {i} (integer) differs"


# The parity presets (torch-autocast, tf-amp) lower the same ops as fp16 on these CNNs; on the
# light models, whose calibrated conversions cost seconds each (VGG-19: ~4 s), they run on the
# three cheapest only. Everything else is the full cross product.
PARITY_PRESETS = ("torch-autocast", "tf-amp")
LIGHT_PARITY_SUBSET = ("light/inception_v1", "light/shufflenet", "light/squeezenet")


def _covered(model: str, preset: str) -> bool:
    return not (
        model.startswith("light/") and preset in PARITY_PRESETS and model not in LIGHT_PARITY_SUBSET
    )


CASES = [pytest.param(m, p, id=f"{m}-{p}") for m in MODELS for p in PRESETS if _covered(m, p)]
LOW_CASES = [c for c in CASES if c.values[1] != "fp32"]


def test_models_found() -> None:
    assert sum(n.startswith("light/") for n in MODELS) == 9
    assert sum(n.startswith("pytorch/") for n in MODELS) >= 80
    assert sum(n.startswith("zoo/") for n in MODELS) == 10


def test_ort_unrunnable_models() -> None:
    unrunnable = {n for n in MODELS if isinstance(reference(n), str)}
    assert unrunnable == ORT_UNRUNNABLE
    print(
        f"\n{len(unrunnable)} of {len(MODELS)} models skipped: ORT CPU cannot run them in float32"
    )


@pytest.mark.parametrize(("name", "preset"), CASES)
def test_native_is_valid(name: str, preset: str) -> None:
    """(a), (c), (f), (g) on the native lowering."""
    ref = reference_or_skip(name)
    data, model = converted(name, preset, False)
    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, strict_mode=True, check_type=True)
    check_casts(model)
    # (g) inserted casts: audit == metadata == all Casts minus the input model's surviving ones.
    report = audit(model)
    original = {n.name for n in fresh_proto(name).graph.node if n.op_type == "Cast"}
    casts = [n for n in model.graph if n.op_type == "Cast"]
    marked = [n for n in casts if n.metadata_props.get(md.NODE_INSERTED) == "cast"]
    kept = [n for n in casts if n.name in original and md.NODE_INSERTED not in n.metadata_props]
    assert report.casts_inserted == len(marked) == len(casts) - len(kept)
    assert report.rounds_inserted == 0
    # (c) ORT CPU runs float16 natively (behind its own casts); bfloat16 has no CPU kernels.
    if low_dtype(preset) == ir.DataType.FLOAT16:
        check_close(run_converted(data, name), ref, name, preset, "native")


@pytest.mark.parametrize(("name", "preset"), LOW_CASES)
def test_emulated_matches_fp32(name: str, preset: str) -> None:
    """(b), (f) on the CPU emulation."""
    ref = reference_or_skip(name)
    data, model = converted(name, preset, True)
    check_casts(model)
    report = audit(model)
    assert report.emulated
    assert report.casts_total == report.casts_inserted + report.rounds_inserted + sum(
        1 for n in model.graph if n.op_type == "Cast" and md.NODE_INSERTED not in n.metadata_props
    )
    check_close(run_converted(data, name), ref, name, preset, "emulated")


@pytest.mark.parametrize("emulate", [False, True], ids=["native", "emulated"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fp32_is_identity(name: str, emulate: bool) -> None:
    """(d) the identity preset changes no output bit."""
    ref = reference_or_skip(name)
    data, _ = converted(name, "fp32", emulate)
    for out, r in zip(run_converted(data, name), ref):
        assert out.dtype == r.dtype and np.array_equal(out, r, equal_nan=True)


@pytest.mark.parametrize("emulate", [False, True], ids=["native", "emulated"])
@pytest.mark.parametrize(("name", "preset"), CASES)
def test_idempotent(name: str, preset: str, emulate: bool) -> None:
    """(e) converting the result again with the same policy is a no-op, byte for byte."""
    reference_or_skip(name)
    data, _ = converted(name, preset, emulate)
    again = convert(onnx.load_from_string(data), preset, emulate=emulate)
    assert ir.to_proto(again).SerializeToString() == data


def check_casts(model: ir.Model) -> None:
    """(f) no foldable Cast chain, no duplicate Cast of one tensor to one dtype."""
    targets: set[tuple[ir.Value, ir.DataType]] = set()
    for node in model.graph:
        if node.op_type != "Cast":
            continue
        src, to = node.inputs[0], ir.DataType(node.attributes["to"].value)
        assert src is not None
        assert (src, to) not in targets, f"tensor '{src.name}' cast twice to {to.name}"
        targets.add((src, to))
        first = src.producer()
        if first is None or first.op_type != "Cast" or first.inputs[0] is None:
            continue
        origin, mid = first.inputs[0].dtype, ir.DataType(first.attributes["to"].value)
        assert origin is not None, (
            f"Cast '{first.name}' reads '{first.inputs[0].name}' of unknown dtype"
        )
        if is_float(origin) and is_float(to):
            assert not is_lossless(origin, mid), (
                f"Cast '{node.name}' reads Cast '{first.name}' ({origin.name} -> {mid.name} is lossless): should fold"
            )


def test_alexnet_fp16_needs_calibration() -> None:
    """Without calibration, float16 AlexNet overflows (activations reach ~1e31): NaN/inf out."""
    name = "light/bvlc_alexnet"
    ref = reference_or_skip(name)
    assert all(np.isfinite(r).all() for r in ref)
    model = convert(fresh_proto(name), "fp16", emulate=True)
    outs = run_converted(ir.to_proto(model).SerializeToString(), name)
    assert not all(np.isfinite(o).all() for o in outs)
    # With calibration the same preset is finite and matches (test_emulated_matches_fp32).
    data, _ = converted(name, "fp16", True)
    assert all(np.isfinite(o).all() for o in run_converted(data, name))


def test_error_summary() -> None:
    """Prints the worst errors the tables above measured (run with -s to see them)."""
    for (preset, kind), (err, where) in sorted(MEASURED.items()):
        print(f"{preset:>15} {kind:>9}: max relative L2 {err:.2e} ({where})")
