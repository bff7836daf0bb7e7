"""``mpgraph tune`` next to onnxconverter-common's ``auto_convert_mixed_precision``, side by side.

Same model, same inputs, same objective: every output finite and within ``--tol`` relative L2
error of float32's. The models: the zoo GPT with one planted overflowing op (``blocks.0.out``'s
weight scaled by 1e5: that MatMul passes float16's 65504, see tests/test_tune.py) and the zoo GPT
as is. For each tool: wall time, conversions tried, nodes kept float32, and the final error.

onnxconverter-common is not an mpgraph dependency; install it into the venv to run this
(``pip install onnxconverter-common``). Its search converts to native float16 and measures on ORT
CPU (which computes float16 ops in float32 behind casts); mpgraph measures its CPU emulation.

    OMP_NUM_THREADS=1 python benchmarks/tune_vs_occ.py [--big]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpgraph.tune import OutputTolerance, relative_error, tune  # noqa: E402


def zoo_gpt() -> onnx.ModelProto:
    """The zoo GPT with its weights as plain initializers: the export lists them as graph inputs
    too, which onnxconverter-common's float16 pass breaks (it lowers the initializer and keeps
    the input float32, and ORT refuses the mismatch). Both tools get this same model."""
    model = onnx.load("models/onnx/gpt.onnx")
    names = {init.name for init in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model


def planted_gpt(factor: float) -> onnx.ModelProto:
    model = zoo_gpt()
    for init in model.graph.initializer:
        if init.name == "blocks.0.out.weight":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), init.name))
    return model


def planted_transformer() -> onnx.ModelProto:
    """bench_convert.py's 310-block transformer (10,231 nodes) with block 100's MLP output
    overflowing float16: ln2 gain x100 and down-projection weight x5e5 (weights stay below
    65504, so the initializer range rule does not catch it, while the MatMul output passes 65504)."""
    from bench_convert import build_transformer

    model = build_transformer(310)
    factors = {"b100.ln2.g": 100.0, "b100.down.w": 5e5}
    for init in model.graph.initializer:
        if init.name in factors:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factors[init.name]), init.name))
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def occ(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float) -> str:
    import onnxruntime as ort
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision

    ort.set_default_logger_severity(3)  # its sessions warn once per initializer otherwise

    ref = run(model, feeds)
    attempts = 0

    def within(res0: list[np.ndarray], res1: list[np.ndarray]) -> bool:
        nonlocal attempts
        attempts += 1
        return all(relative_error(a, b.astype(np.float32)) <= tol for a, b in zip(res0, res1))

    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "-inf will be truncated to -10000.0" (the causal mask)
            converted = auto_convert_mixed_precision(model, feeds, validate_fn=within, keep_io_types=True)
    except Exception as e:  # noqa: BLE001 - report what the other tool does, whatever it raises
        return f"failed after {time.perf_counter() - start:.2f} s: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    seconds = time.perf_counter() - start
    done = next((line for line in log.getvalue().splitlines() if line.startswith("Done:")), "Done: []")
    kept = ast.literal_eval(done[len("Done:"):].strip())
    err = max(relative_error(a, b.astype(np.float32)) for a, b in zip(ref, run(converted, feeds)))
    bad = nonfinite_fp16_values(converted, model, feeds)
    return (f"{seconds:7.2f} s  {attempts:4d} validations  {len(kept):3d} nodes kept float32  final error {err:.3g}  "
            f"float16 values non-finite when exposed: {len(bad)}{' ' + str(bad[:3]) if bad else ''}")


def nonfinite_fp16_values(model: onnx.ModelProto, reference: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[str]:
    """float16 node outputs with inf/NaN entries, when made graph outputs, whose float32 twin
    (same name in ``reference``) is finite. ORT CPU computes float16 ops in float32 and hands
    consumers the float32 copy, so a value can overflow without its consumers (or the final
    outputs) seeing it; a float16 kernel would pass the inf on."""
    inferred = onnx.shape_inference.infer_shapes(model)
    fp16 = {v.name for v in inferred.graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    twins = {o for n in reference.graph.node for o in n.output}
    names = [o for n in model.graph.node for o in n.output if o in fp16 and o in twins]

    def values(m: onnx.ModelProto) -> list[np.ndarray]:
        exposed = onnx.ModelProto()
        exposed.CopyFrom(m)
        exposed.graph.output.extend(onnx.ValueInfoProto(name=o) for o in names)
        return run(exposed, feeds)[len(m.graph.output):]

    return [n for n, low, ref in zip(names, values(model), values(reference))
            if np.isfinite(ref).all() and not np.isfinite(low).all()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tols", default="2e-3,1e-4", help="Comma-separated tolerances, one round each.")
    parser.add_argument("--factor", type=float, default=1e5)
    parser.add_argument("--big", action="store_true", help="Also the 10,231-node transformer with a planted overflow.")
    args = parser.parse_args()
    feeds = {"tokens": np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int64)}
    print(f"objective: outputs finite, relative L2 error <= tol; inputs: tokens[4, 16] seed 0; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs visible")
    for tol in (float(t) for t in args.tols.split(",")):
        for label, model in ((f"gpt planted x{args.factor:g}", planted_gpt(args.factor)), ("gpt", zoo_gpt())):
            n = len(model.graph.node)
            result = tune(model, "fp16", objective=OutputTolerance(tol), feeds=feeds)
            print(f"tol {tol:g}  {label:18s} {n:3d} nodes  mpgraph tune:         {result.seconds:7.2f} s  "
                  f"{result.evaluations:4d} conversions  {len(result.kept):3d} nodes kept float32  final error "
                  f"{result.error_after:.3g}  {result.kept}", flush=True)
            try:
                line = occ(model, feeds, tol)
            except ImportError:
                line = "not installed (pip install onnxconverter-common)"
            print(f"tol {tol:g}  {label:18s} {n:3d} nodes  onnxconverter-common: {line}", flush=True)
    if args.big:
        model = planted_transformer()
        x = {"x": np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)}
        tol = float(args.tols.split(",")[0])
        result = tune(model, "fp16", objective=OutputTolerance(tol), feeds=x)
        print(f"tol {tol:g}  transformer planted {len(model.graph.node)} nodes  mpgraph tune: {result.seconds:7.2f} s  "
              f"{result.evaluations:4d} conversions  {len(result.kept):3d} of {result.candidates} lowered nodes kept float32  "
              f"final error {result.error_after:.3g}  {result.kept}", flush=True)
        print(f"tol {tol:g}  transformer planted {len(model.graph.node)} nodes  onnxconverter-common: {occ(model, x, tol)}",
              flush=True)


if __name__ == "__main__":
    main()
