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

The light models hold constant 0.02 weights: their float32 activations can pass float16's 65504,
so float16 presets convert them with ``calibrate=`` the same inputs (ops whose activations
overflow stay float32); ``test_alexnet_fp16_needs_calibration`` shows that without calibration
the float16 emulation of AlexNet produces NaN/inf. Their outputs are a softmax over 1000 equal
logits (0.001 everywhere), so comparing their outputs compares nothing: (b), (c) and (d) leave
them out (they are not parametrized, so nothing is skipped at run time); (a), (e)-(g) apply.
The pytorch-converted and zoo models carry the numerical signal.

ORT CPU cannot run 23 of the 83 pytorch-converted files in float32 (opset-6 kernels ORT dropped:
AveragePool-1, BatchNormalization-6, Gemm-6, Mul/Add-6 with broadcast attributes, PRelu-6);
``test_ort_unrunnable_models`` pins that list. Validity and idempotence, (a) (e) (f) (g), run on
the files as they are; the numerical checks (b) (c) (d) run on each file upgraded to opset 13
(``upgraded``), whose ORT outputs match the outputs stored beside the file
(``test_upgraded_references_match_stored_outputs``).

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

from mpgraph.audit.report import audit
from mpgraph.convert import convert
from mpgraph.dtypes import is_float, is_lossless
from mpgraph.policy import list_presets, load_policy
from tests.helpers import shared_range_checks

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
# checks that once instead of per model. fp8 is bf16 plus quantised matrix operands, whose error
# is not bf16's: tests/test_fp8*.py check it.
PRESETS = [p for p in list_presets() if p not in ("tf32", "fp8")]
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

# ORT 1.32 CPU has no kernel for these old-opset nodes; pinned so a change shows up. Their numeric
# checks run on the opset-13 upgrade (`upgraded`).
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


def upgraded(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model converted to opset 13, which ORT CPU runs.

    PRelu-6 broadcast a ``[C]`` slope over axis 1; from opset 7 the slope broadcasts numpy-style
    from the last axis, and the version converter leaves the slope as it is, so a ``[C]`` slope
    on an input of rank r > 2 is reshaped here to ``[C, 1, ...]``.
    """
    model = onnx.version_converter.convert_version(proto, 13)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in model.graph.input}
    slopes = {n.input[1]: ranks.get(n.input[0], 0) for n in model.graph.node if n.op_type == "PRelu"}
    for tensor in model.graph.initializer:
        rank = slopes.get(tensor.name, 0)
        if len(tensor.dims) == 1 and tensor.dims[0] > 1 and rank > 2:
            new_dims = [tensor.dims[0]] + [1] * (rank - 2)
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).reshape(new_dims), tensor.name))
            for v in model.graph.input:
                if v.name == tensor.name:
                    v.CopyFrom(onnx.helper.make_tensor_value_info(v.name, tensor.data_type, new_dims))
    return model


@functools.cache
def source_bytes(name: str) -> bytes:
    """The model the numerical checks run: the file, or its opset-13 upgrade where ORT can't run it."""
    return upgraded(fresh_proto(name)).SerializeToString() if name in ORT_UNRUNNABLE else model_bytes(name)


def session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # zoo parameters are inputs with initializers: by design
    options.intra_op_num_threads = 1
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
def reference(name: str) -> list[np.ndarray]:
    """Float32 outputs of the source model (``source_bytes``) in ORT CPU."""
    return session(source_bytes(name)).run(None, feeds(name))


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
def converted(name: str, preset: str, emulate: bool, source: bool = False) -> tuple[bytes, ir.Model]:
    """The file converted, or with ``source`` the model the numerical checks run converted.

    The native and emulated conversions of one model under one float16 preset range-check the
    same float32 model on the same inputs: measured once (light VGG-19: 2 s of CPU each time).
    """
    proto = onnx.load_from_string(source_bytes(name)) if source else fresh_proto(name)
    with shared_range_checks():
        model = convert(proto, preset, emulate=emulate, calibrate=calibration(name, preset))
    return ir.to_proto(model).SerializeToString(), model


def converted_source(name: str, preset: str, emulate: bool) -> tuple[bytes, ir.Model]:
    """Like ``converted``, for the model ``reference`` ran (the same conversion unless upgraded)."""
    return converted(name, preset, emulate, source=name in ORT_UNRUNNABLE)


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


def check_close(outs: list[np.ndarray], ref: list[np.ndarray], preset: str) -> None:
    tol = REL_L2_TOL[low_dtype(preset)]
    assert len(outs) == len(ref)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.shape == r.shape, f"output {i}: shape {out.shape} != {r.shape}"
        if np.issubdtype(r.dtype, np.floating):
            assert np.isfinite(out).all() or not np.isfinite(r).all(), f"output {i} has NaN/inf"
            err = rel_l2(out, r)
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
# The light models' outputs are constant (module docstring): no numerical comparison.
LOW_CASES = [c for c in CASES if c.values[1] != "fp32" and not c.values[0].startswith("light/")]


def test_models_found() -> None:
    assert sum(n.startswith("light/") for n in MODELS) == 9
    assert sum(n.startswith("pytorch/") for n in MODELS) >= 80
    assert sum(n.startswith("zoo/") for n in MODELS) == 10


def _ort_runs(data: bytes, name: str) -> bool:
    try:
        session(data).run(None, feeds(name))
    except Exception:  # noqa: BLE001 - ORT raises its own exception types
        return False
    return True


def test_ort_unrunnable_models() -> None:
    """The pinned list is exactly the pytorch-converted files ORT CPU cannot run."""
    pytorch = [n for n in MODELS if n.startswith("pytorch/")]
    assert {n for n in pytorch if not _ort_runs(model_bytes(n), n)} == ORT_UNRUNNABLE


@pytest.mark.parametrize("name", sorted(ORT_UNRUNNABLE))
def test_upgraded_references_match_stored_outputs(name: str) -> None:
    """The opset-13 upgrade reproduces the outputs stored with the file (measured: <= 2.4e-7)."""
    stored = sorted(MODELS[name].parent.glob("test_data_set_0/output_*.pb"))
    expected = [numpy_helper.to_array(onnx.load_tensor(str(p))) for p in stored]
    got = reference(name)
    assert len(got) == len(expected) == 1
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "preset"), CASES)
def test_native_is_valid(name: str, preset: str) -> None:
    """(a), (c), (e), (f), (g) on the native lowering."""
    data, model = converted(name, preset, False)
    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, strict_mode=True, check_type=True)
    check_casts(model)
    # (g) the audit's counts against the graphs themselves, not against the metadata it reads.
    report = audit(model)
    new = new_casts(name, model)
    assert report.casts_inserted == len(new) and report.rounds_inserted == 0
    assert report.casts_total == sum(n.op_type == "Cast" for n in model.graph)
    # (c) ORT CPU runs float16 natively (behind its own casts); bfloat16 has no CPU kernels.
    if low_dtype(preset) == ir.DataType.FLOAT16 and not name.startswith("light/"):
        source, _ = converted_source(name, preset, False)
        check_close(run_converted(source, name), reference(name), preset)
    # (e) here, where the conversion is made: a test of its own could run on the other
    # pytest-xdist worker and convert again (light VGG-19 in float16: seconds).
    check_idempotent(data, preset, False)


# Right after test_native_is_valid: pytest-xdist hands out neighbouring tests to one worker,
# which then range-checks a light model once for both lowerings (``converted``).
@pytest.mark.parametrize(("name", "preset"), CASES)
def test_emulated_is_idempotent(name: str, preset: str) -> None:
    """(e) on the emulated lowering of the file (the native one: ``test_native_is_valid``)."""
    data, _ = converted(name, preset, True)
    check_idempotent(data, preset, True)


def check_idempotent(data: bytes, preset: str, emulate: bool) -> None:
    """(e) converting the result again with the same policy is a no-op, byte for byte."""
    again = convert(onnx.load_from_string(data), preset, emulate=emulate)
    assert ir.to_proto(again).SerializeToString() == data


@pytest.mark.parametrize(("name", "preset"), LOW_CASES)
def test_emulated_matches_fp32(name: str, preset: str) -> None:
    """(b), (f) on the CPU emulation."""
    data, model = converted_source(name, preset, True)
    check_casts(model)
    report = audit(model)
    assert report.emulated
    new = new_casts(name, model)
    rounds = [n for n in new if n.name.startswith("round/")]
    assert report.rounds_inserted == len(rounds) and report.casts_inserted == len(new) - len(rounds)
    assert report.casts_total == sum(n.op_type == "Cast" for n in model.graph)
    check_close(run_converted(data, name), reference(name), preset)


@pytest.mark.parametrize("emulate", [False, True], ids=["native", "emulated"])
@pytest.mark.parametrize("name", [m for m in MODELS if not m.startswith("light/")])
def test_fp32_is_identity(name: str, emulate: bool) -> None:
    """(d) the identity preset changes no output bit."""
    data, _ = converted_source(name, "fp32", emulate)
    for out, r in zip(run_converted(data, name), reference(name)):
        assert out.dtype == r.dtype and np.array_equal(out, r, equal_nan=True)


def new_casts(name: str, model: ir.Model) -> list[ir.Node]:
    """The nodes mpgraph added, told by name (the input's nodes keep theirs); all must be Casts."""
    original = {n.name for n in onnx.load_from_string(source_bytes(name)).graph.node} | {
        n.name for n in fresh_proto(name).graph.node
    }
    new = [n for n in model.graph if n.name not in original]
    assert all(n.op_type == "Cast" for n in new), sorted({n.op_type for n in new})
    return new


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
    """Without the range check, float16 AlexNet overflows (NaN/inf out); with it, on the same
    inputs or on the default seeded random ones, the output is finite."""
    name = "light/bvlc_alexnet"
    ref = reference(name)
    assert all(np.isfinite(r).all() for r in ref)
    model = convert(fresh_proto(name), "fp16", emulate=True, calibrate=None)  # the range check off
    outs = run_converted(ir.to_proto(model).SerializeToString(), name)
    assert not all(np.isfinite(o).all() for o in outs)
    data, _ = converted(name, "fp16", True)  # calibrated on feeds(name)
    assert all(np.isfinite(o).all() for o in run_converted(data, name))
    default = convert(fresh_proto(name), "fp16", emulate=True)  # calibrate="auto"
    assert all(np.isfinite(o).all() for o in run_converted(ir.to_proto(default).SerializeToString(), name))


@pytest.mark.parametrize(
    ("preset", "measured"), [("fp16", 6.8e-4), ("bf16", 4.5e-3)], ids=["fp16", "bf16"]
)
def test_tolerance_is_tight(preset: str, measured: float) -> None:
    """REL_L2_TOL is within 10x of the worst error the table produces (zoo/resnet.loss, emulated).

    Measured (ORT 1.32 CPU): fp16 6.8e-4 against 2e-3, bf16 4.5e-3 against 2e-2.
    """
    name = "zoo/resnet.loss"
    data, _ = converted_source(name, preset, True)
    outs, ref = run_converted(data, name), reference(name)
    worst = max(rel_l2(o, r) for o, r in zip(outs, ref) if np.issubdtype(r.dtype, np.floating))
    tol = REL_L2_TOL[low_dtype(preset)]
    assert tol / 10 < worst <= tol
    assert worst == pytest.approx(measured, rel=0.5)
