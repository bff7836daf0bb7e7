"""Small graph builders shared by the tests (raw protobuf is fine at the test boundary)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_model(nodes, inputs, outputs, initializers=(), opset=18, ir_version=9) -> onnx.ModelProto:
    graph = h.make_graph(list(nodes), "g", list(inputs), list(outputs), initializer=list(initializers))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def vi(name, shape, dtype=T.FLOAT):
    return h.make_tensor_value_info(name, dtype, shape)


def init(name, array):
    return onnx.numpy_helper.from_array(np.asarray(array), name)


def mlp_model() -> onnx.ModelProto:
    """x -> MatMul(allow1) -> Add(infer1) -> Relu(clear1) -> MatMul(allow2) -> Softmax(deny1) -> Mul(infer2)

    Nodes named after their category, so tests of the precision phases read like a spec.
    """
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((4, 8)).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    w2 = rng.standard_normal((8, 3)).astype(np.float32)
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"], name="allow1"),
        h.make_node("Add", ["a", "b1"], ["b"], name="infer1"),
        h.make_node("Relu", ["b"], ["c"], name="clear1"),
        h.make_node("MatMul", ["c", "w2"], ["d"], name="allow2"),
        h.make_node("Softmax", ["d"], ["e"], name="deny1", axis=-1),
        h.make_node("Mul", ["e", "e"], ["y"], name="infer2"),
    ]
    return make_model(nodes, [vi("x", ["N", 4])], [vi("y", ["N", 3])], [init("w1", w1), init("b1", b1), init("w2", w2)])


def random_batches(trainer, count: int, batch: int, *, seed: int = 0, high: int = 2) -> list[dict[str, np.ndarray]]:
    """``count`` batches for a ``Trainer``'s data inputs, every symbolic dimension ``batch``:
    floats standard normal, integers (labels, token ids) in ``[0, high)``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        feeds = {}
        for spec in trainer.data_inputs:
            shape = [d if isinstance(d, int) else batch for d in spec.shape]
            values = rng.standard_normal(shape) if spec.dtype.kind == "f" else rng.integers(0, high, shape)
            feeds[spec.name] = values.astype(spec.dtype)
        out.append(feeds)
    return out


def run(model, feeds):
    proto = model if isinstance(model, onnx.ModelProto) else __import__("onnx_ir").to_proto(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def cpu_session(model: bytes, *, library: bool = False) -> ort.InferenceSession:
    """A one-thread ORT CPU session (two test processes share the two cores) of a serialized
    model, with mpgraph's kernel library registered when ``library`` (a lowered graph)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    if library:
        from mpgraph import lowering as kernels

        options.register_custom_ops_library(str(kernels.library("cpu")))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def run_named(model, feeds, *, library: bool = False) -> dict:
    """Every output of ``model`` (an ``onnx_ir`` model) by name, from ``cpu_session``."""
    import onnx_ir

    session = cpu_session(onnx_ir.to_proto(model).SerializeToString(), library=library)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def run_cpu(model, feeds, *, library: bool = False):
    """The first output of ``model`` (an ``onnx_ir`` model) in an ORT CPU session with two
    intra-op threads (the lowerings' parallel paths), with mpgraph's kernel library registered
    when ``library``."""
    import onnx_ir

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 2
    if library:
        from mpgraph import lowering as kernels

        options.register_custom_ops_library(str(kernels.library("cpu")))
    session = ort.InferenceSession(onnx_ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@dataclasses.dataclass(frozen=True)
class Ran:
    """What a ``mpgraph`` command left: exit code, stdout, stderr (as ``subprocess.run`` names them)."""

    returncode: int
    stdout: str
    stderr: str


def mpgraph_cli(*args: str) -> Ran:
    """``mpgraph ARGS`` in this process, against the real app of ``mpgraph.cli.main`` (the entry
    point's own object, so every command and the error boundary are the user's), without the
    2-3 s of a new interpreter per call."""
    from typer.testing import CliRunner

    from mpgraph.cli.main import app

    result = CliRunner().invoke(app, list(args))
    return Ran(result.exit_code, result.stdout, result.stderr)


# Range checks measured once per float32 model (``shared_range_checks``): model digest, feeds,
# low dtype and source -> the Calibration ``measure_ranges`` returned.
_MEASURED: dict[tuple, object] = {}


@contextlib.contextmanager
def shared_range_checks() -> Iterator[None]:
    """Inside the block, ``mpgraph.convert`` measures each float32 model's ranges once per
    process for given feeds and low dtype, instead of once per conversion.

    The range check runs the float32 model, the same for every float16 preset, native and
    emulated: light VGG-19 converted under fp16, tf-amp and torch-autocast, both ways, ran it
    six times (2 s of CPU each). The key is the serialized model the check runs, the feeds'
    bytes, the dtype, the source and ``MATERIALIZE_BYTES``, so a change to what convert
    measures is measured afresh (and the first measurement in a process is always a fresh
    one); each conversion gets its own copy of the containers. Nothing else is shared.
    """
    import importlib

    import onnx_ir

    from mpgraph.runtime import probe

    # The module, not the function ``mpgraph.convert`` that its package exports under its name.
    converting = importlib.import_module("mpgraph.convert")

    measure = converting.measure_ranges

    def shared(model, feeds, low, *, source="given inputs", proto=None):
        data = (proto if proto is not None else onnx_ir.to_proto(model)).SerializeToString(deterministic=True)
        key = (hashlib.sha256(data).digest(), low, source, probe.MATERIALIZE_BYTES, *(
            (name, a.dtype.str, a.shape, hashlib.sha256(np.ascontiguousarray(a)).digest())
            for name, a in sorted((k, np.asarray(v)) for k, v in feeds.items())
        ))
        if key not in _MEASURED:
            _MEASURED[key] = measure(model, feeds, low, source=source, proto=proto)
        got = _MEASURED[key]
        return dataclasses.replace(got, feeds=dict(got.feeds), ranges=dict(got.ranges),
                                   outputs={k: v.copy() for k, v in got.outputs.items()})

    converting.measure_ranges = shared
    try:
        yield
    finally:
        converting.measure_ranges = measure


def step_feeds(model: onnx.ModelProto, x: np.ndarray | None = None, seed: int = 2) -> dict[str, np.ndarray]:
    """Every graph input of a step graph that is no initializer, from a fixed seed: ``x`` as
    given (standard normal when ``None``), other floats small and positive (parameters,
    moments, the learning rate), integers ones (the step count)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        t = value.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if value.name == "x":
            feeds["x"] = x if x is not None else rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "f":
            feeds[value.name] = (0.01 + 0.1 * np.abs(rng.standard_normal(shape))).astype(dtype)
        else:
            feeds[value.name] = np.ones(shape, dtype=dtype)
    return feeds


def assert_outputs_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: float) -> None:
    """Every non-empty float output of ``want`` within ``tol`` of ``got``, relative to its
    largest magnitude."""
    for name, value in want.items():
        if value.dtype.kind != "f" or not value.size:
            continue
        err = float(np.abs(got[name] - value).max() / max(np.abs(value).max(), 1e-6))
        assert err < tol, (name, err)


def cublaslt_cuda_library(missing: str) -> str:
    """The CUDA kernel library's path for a GPU test of its cuBLASLt ops (GemmBias, GemmFp8):
    skips without onnxruntime-gpu, or (``missing``, then why) when the library was built without
    cuBLASLt."""
    import pytest

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    from mpgraph.lowering.build import cublaslt_flags
    from mpgraph.lowering.plan import has_gemm_bias
    from mpgraph.lowering.plan import library as build

    path = str(build("cuda"))
    if not has_gemm_bias(path):
        pytest.skip(f"{missing}: {cublaslt_flags()[1]}")
    return path
