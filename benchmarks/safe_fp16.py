"""The issue-9 "done" check for float16 with default flags, as numbers.

For the 10 zoo models, the onnx wheel's 9 light models and the T5 with overflowing
feed-forward outputs (``tests/test_safe_fp16.py``'s builder), converts with
``mpgraph.convert(model, "fp16", emulate=True)`` (the range check on seeded random inputs,
seed 0, is the default) and prints, on inputs of seed 1, the worst relative L2 error of a
float output against float32 and whether every output is finite; then the same T5 without
the check.

Usage:
    .venv/bin/python benchmarks/safe_fp16.py
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from test_safe_fp16 import LIGHT, ZOO, _rel, _run, random_feeds, t5_overflowing  # noqa: E402

import mpgraph  # noqa: E402
from mpgraph._ir import meta as md  # noqa: E402


def row(name: str, model: onnx.ModelProto, **kwargs: object) -> None:
    feeds = random_feeds(ir.from_proto(model), seed=1)
    ref = _run(model, feeds)
    start = time.perf_counter()
    converted = mpgraph.convert(onnx.load_from_string(model.SerializeToString()), "fp16", emulate=True, **kwargs)
    seconds = time.perf_counter() - start
    outs = _run(converted, feeds)
    floats = [(o, r) for o, r in zip(outs, ref) if r.dtype.kind == "f"]
    finite = all(np.isfinite(o).all() for o, _ in floats)
    worst = max(_rel(np.nan_to_num(o), r) for o, r in floats)
    summary = json.loads(converted.metadata_props.get(md.MODEL_CALIBRATION, "{}"))
    kept = summary.get("kept_float32", "no check")
    print(f"{name:28s} {seconds:6.2f}s  finite={str(finite):5s}  max rel L2 {worst:.2e}  kept float32: {kept}  "
          f"values flushing: {summary.get('values_flushing', '-')}")


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    for path in ZOO + LIGHT:
        row(os.path.basename(path), onnx.load(path))
    t5 = t5_overflowing()
    row("t5 (wo x1e5)", t5)
    row("t5 (wo x1e5), --no-calibrate", t5, calibrate=None)


if __name__ == "__main__":
    main()
