"""Conversion speed on a >10,000-node transformer: mpgraph next to onnxconverter-common.

Builds an ONNX graph of N pre-LN transformer blocks (LayerNormalization, q/k/v MatMul + bias,
Reshape/Transpose into heads, scaled QK^T, Softmax, attention MatMul, output projection,
residual Add, LayerNormalization, 4x MLP with erf-form GELU, residual Add) with random float32
weights (d=64, 4 heads, seq 16), then times, in one run, the best of ``--repeat`` rounds (each
round runs every configuration once, so load from other work lands on all rows alike):

* ``mpgraph.convert(model, bf16|fp16, validate=True|False)`` (native lowering; the time
  includes reading the ModelProto into onnx-ir, not serialising the result), float16 both
  without the range check (``calibrate=None``) and with it (the default: the float32 graph
  runs once on seeded random inputs and every float activation comes back to be reduced in
  numpy, as activations under ``probe.MATERIALIZE_BYTES`` do; then the emulated result runs
  once to check its outputs are finite), so the two rows give the check's cost;
* ``onnxconverter_common.float16.convert_float_to_float16(model, keep_io_types=True)``;

and prints a table of wall-clock and process CPU seconds (all threads; CPU time stretches far
less when other work loads the machine), each with its ratio to onnxconverter-common, plus
whether each result loads and runs in ONNX Runtime's CPU provider, and the load average at
start and end (the machine may be shared). ``--profile`` adds a cProfile of the slowest mpgraph configuration.

Usage:
    .venv/bin/python benchmarks/bench_convert.py [--blocks 310] [--repeat 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import logging
import os
import platform
import pstats
import time
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from mpgraph.convert import convert

D_MODEL, HEADS, SEQ = 64, 4, 16
HEAD_DIM = D_MODEL // HEADS


def build_transformer(blocks: int, seed: int = 0) -> onnx.ModelProto:
    """``blocks`` pre-LN transformer blocks on x: [batch, SEQ, D_MODEL] (opset 18)."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(name: str, *shape: int) -> str:
        return const(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def node(op: str, inputs: list[str], name: str, **attrs: object) -> str:
        nodes.append(h.make_node(op, inputs, [name], name=name, **attrs))
        return name

    heads_shape = const("shape/heads", np.array([0, SEQ, HEADS, HEAD_DIM], np.int64))
    merged_shape = const("shape/merged", np.array([0, SEQ, D_MODEL], np.int64))
    scale = const("const/scale", np.array(1.0 / np.sqrt(HEAD_DIM), np.float32))
    sqrt2 = const("const/sqrt2", np.array(np.sqrt(2.0), np.float32))
    one = const("const/one", np.array(1.0, np.float32))
    half = const("const/half", np.array(0.5, np.float32))
    x = "x"
    for b in range(blocks):
        p = f"b{b}"
        ln1 = node(
            "LayerNormalization",
            [x, weight(f"{p}.ln1.g", D_MODEL), weight(f"{p}.ln1.b", D_MODEL)],
            f"{p}/ln1",
            axis=-1,
        )
        heads = {}
        for t in "qkv":
            proj = node("MatMul", [ln1, weight(f"{p}.{t}.w", D_MODEL, D_MODEL)], f"{p}/{t}")
            biased = node("Add", [proj, weight(f"{p}.{t}.b", D_MODEL)], f"{p}/{t}_bias")
            split = node("Reshape", [biased, heads_shape], f"{p}/{t}_heads")
            perm = [0, 2, 3, 1] if t == "k" else [0, 2, 1, 3]
            heads[t] = node("Transpose", [split], f"{p}/{t}_t", perm=perm)
        scores = node("MatMul", [heads["q"], heads["k"]], f"{p}/scores")
        scaled = node("Mul", [scores, scale], f"{p}/scaled")
        probs = node("Softmax", [scaled], f"{p}/probs", axis=-1)
        attn = node("MatMul", [probs, heads["v"]], f"{p}/attn")
        attn_t = node("Transpose", [attn], f"{p}/attn_t", perm=[0, 2, 1, 3])
        merged = node("Reshape", [attn_t, merged_shape], f"{p}/merged")
        out = node("MatMul", [merged, weight(f"{p}.o.w", D_MODEL, D_MODEL)], f"{p}/o")
        out_b = node("Add", [out, weight(f"{p}.o.b", D_MODEL)], f"{p}/o_bias")
        x = node("Add", [x, out_b], f"{p}/res1")
        ln2 = node(
            "LayerNormalization",
            [x, weight(f"{p}.ln2.g", D_MODEL), weight(f"{p}.ln2.b", D_MODEL)],
            f"{p}/ln2",
            axis=-1,
        )
        fc = node("MatMul", [ln2, weight(f"{p}.fc.w", D_MODEL, 4 * D_MODEL)], f"{p}/fc")
        fc_b = node("Add", [fc, weight(f"{p}.fc.b", 4 * D_MODEL)], f"{p}/fc_bias")
        # GELU, erf form: 0.5 * x * (1 + erf(x / sqrt(2))).
        div = node("Div", [fc_b, sqrt2], f"{p}/gelu_div")
        erf = node("Erf", [div], f"{p}/gelu_erf")
        plus = node("Add", [erf, one], f"{p}/gelu_add")
        mul = node("Mul", [fc_b, plus], f"{p}/gelu_mul")
        gelu = node("Mul", [mul, half], f"{p}/gelu")
        down = node("MatMul", [gelu, weight(f"{p}.down.w", 4 * D_MODEL, D_MODEL)], f"{p}/down")
        down_b = node("Add", [down, weight(f"{p}.down.b", D_MODEL)], f"{p}/down_bias")
        x = node("Add", [x, down_b], f"{p}/res2")
    nodes.append(h.make_node("Identity", [x], ["y"], name="output"))
    graph = h.make_graph(
        nodes,
        "transformer",
        [h.make_tensor_value_info("x", T.FLOAT, ["batch", SEQ, D_MODEL])],
        [h.make_tensor_value_info("y", T.FLOAT, ["batch", SEQ, D_MODEL])],
        initializer=inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 9
    return model


@dataclasses.dataclass
class Best:
    """Best wall-clock and process CPU seconds (all threads) over the rounds, and a result."""

    wall: float = float("inf")
    cpu: float = float("inf")
    result: object = None


def best_of_interleaved(repeat: int, fns: list, model: onnx.ModelProto) -> list[Best]:
    """Best times of each of ``fns`` over ``repeat`` rounds, each round running every one once.

    Interleaved rather than one function's repeats after another's, so a burst of load from
    other work on a shared machine lands on all of them alike, not on one row. CPU time is
    kept beside wall time: on a loaded machine it stretches far less.
    """
    best = [Best() for _ in fns]
    for _ in range(repeat):
        for fn, b in zip(fns, best):
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            wall, cpu = time.perf_counter(), time.process_time()
            b.result = fn(copy)
            b.wall = min(b.wall, time.perf_counter() - wall)
            b.cpu = min(b.cpu, time.process_time() - cpu)
    return best


def ort_status(model: onnx.ModelProto | ir.Model, feed: np.ndarray) -> str:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        return "no: " + str(e).strip().splitlines()[0][:70]
    try:
        inp = session.get_inputs()[0]
        y = session.run(
            None,
            {inp.name: feed.astype(np.float16 if inp.type == "tensor(float16)" else np.float32)},
        )[0]
    except Exception as e:  # noqa: BLE001
        return "loads, run fails: " + str(e).strip().splitlines()[0][:60]
    return "loads+runs" + ("" if np.isfinite(y).all() else " (NaN/inf)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=310)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")  # onnxconverter-common warns about truncated weights

    from onnxconverter_common import __version__ as occ_version
    from onnxconverter_common import float16

    print("load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    model = build_transformer(args.blocks)
    feed = np.random.default_rng(1).standard_normal((2, SEQ, D_MODEL)).astype(np.float32)
    print(
        f"model: {args.blocks} pre-LN transformer blocks, {len(model.graph.node)} nodes, "
        f"{len(model.graph.initializer)} initializers, {model.ByteSize() / 1e6:.1f} MB"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
        f"onnx {onnx.__version__}, onnx-ir {ir.__version__}, onnxruntime {ort.__version__}, "
        f"onnxconverter-common {occ_version}; best of {args.repeat}\n"
    )
    timings: dict[tuple[str, bool], Best] = {}
    configs = [
        ("bf16", True, None, "bf16, validate=on"),
        ("bf16", False, None, "bf16, validate=off"),
        ("fp16", True, None, "fp16, validate=on, no range check"),
        ("fp16", False, None, "fp16, validate=off, no range check"),
        ("fp16", True, "auto", "fp16, validate=on, range check (default)"),
        ("fp16", False, "auto", "fp16, validate=off, range check (default)"),
    ]
    fns = [lambda m: float16.convert_float_to_float16(m, keep_io_types=True)]
    fns += [
        lambda m, p=policy, v=validate, c=calibrate: convert(m, p, validate=v, calibrate=c)
        for policy, validate, calibrate, _ in configs
    ]
    baseline, *results = best_of_interleaved(args.repeat, fns, model)
    rows = [("onnxconverter-common fp16 (keep_io_types)", baseline, ort_status(baseline.result, feed))]  # type: ignore[arg-type]
    for (_, validate, _, label), best in zip(configs, results):
        timings[(label, validate)] = best
        rows.append((f"mpgraph {label}", best, ort_status(best.result, feed)))  # type: ignore[arg-type]
    width = max(len(r[0]) for r in rows)
    print(f"{'converter':<{width}}  {'seconds':>8}  {'vs occ':>7}  {'CPU s':>7}  {'vs occ':>7}  ORT CPU")
    for label, best, status in rows:
        print(
            f"{label:<{width}}  {best.wall:8.3f}  {best.wall / baseline.wall:6.2f}x  "
            f"{best.cpu:7.3f}  {best.cpu / baseline.cpu:6.2f}x  {status}"
        )
    print(
        "\n(bf16 native has no ORT CPU compute kernels, so 'no: ... NOT_IMPLEMENTED' is expected there.)"
    )
    for validate in (True, False):
        off = timings[(f"fp16, validate={'on' if validate else 'off'}, no range check", validate)]
        on = timings[(f"fp16, validate={'on' if validate else 'off'}, range check (default)", validate)]
        print(
            f"range check cost, validate={'on' if validate else 'off'}: {on.wall - off.wall:.2f} s "
            f"({on.wall:.2f} s with, {off.wall:.2f} s without: x{on.wall / off.wall:.2f}); CPU time "
            f"{on.cpu - off.cpu:.2f} s ({on.cpu:.2f} s with, {off.cpu:.2f} s without: x{on.cpu / off.cpu:.2f})"
        )
    slowest = max(timings, key=lambda key: timings[key].wall)
    print(f"slowest mpgraph configuration: {slowest[0]} took {timings[slowest].wall:.2f} s")
    print("load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.profile:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        policy = "bf16" if slowest[0].startswith("bf16") else "fp16"
        calibrate = "auto" if "range check (default)" in slowest[0] else None
        profiler = cProfile.Profile()
        profiler.enable()
        convert(copy, policy, validate=slowest[1], calibrate=calibrate)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(f"\ncProfile of mpgraph {slowest[0]} (top 25 by cumulative time):")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
