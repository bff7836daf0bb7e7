"""Every single-op backend test model that ORT CPU runs converts cleanly or fails clearly.

The models are onnx's own backend node tests (about 1,900 single-op models with inputs and
expected outputs). The onnx wheel here ships no ``backend/test/data/node/`` directory, so they
are generated in memory by ``onnx.backend.test.case.node.collect_testcases`` (the same
generators that write that directory); if the directory exists, it is read instead.

A model is in the table when ORT CPU loads it, runs ``test_data_set_0`` and matches the stored
outputs loosely (rtol 1e-2, atol 1e-3). Converting it with ``fp16`` and ``bf16``, native and
emulated, must either give a model that passes ``onnx.checker`` (full) and strict shape
inference with type checks and (fp16 native, and emulated for both) loads in ORT CPU, or raise
``MpgraphError`` with a one-line message. The models are split into ``SHARDS`` fixed subsets by
a hash of their name, one test per subset (1,500 parametrized cases take too long to collect;
one test over all of them kept one pytest-xdist worker busy for minutes after the other had
finished); ``pytest -s`` shows each subset's counts.

``KNOWN_INVALID`` lists the models whose conversion ends in ``ValidationError`` (the converter
built an invalid model and its own validation caught it), each with the cause; the test pins
that set, so a fix shows up as a failure asking to shrink it. ``KNOWN_CLEAR_ERRORS`` pins the
models refused with another one-line ``MpgraphError`` (none today), and ``ORT_RUNNABLE`` the
size of each subset's table for the onnx/onnxruntime versions it was measured with, so no model
can drop out of the table, or into an error, silently.

Marked slow: the subsets take about 10 s of CPU each (40 s in all, one process).
"""

from __future__ import annotations

import collections
import functools
import glob
import os
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from onnx import numpy_helper

from mpgraph.convert import convert
from mpgraph.errors import MpgraphError, ValidationError
from mpgraph.policy import Policy, load_policy
from tests.helpers import shared_range_checks

NODE_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "node"

KNOWN_INVALID: dict[str, str] = {
    "test_mvn": "the input model already fails strict shape inference (Constant in the MVN function body); the error says so",
    "test_linear_attention_fp16_expanded": (
        "the input already computes in float16 and feeds a Scan: the invariant check flags the Scan "
        "(decided float32 as control flow, reading float16), and the emulation retypes the input's own "
        "float16 values"
    ),
}


# Models refused with a clear (non-validation) MpgraphError, by name: none today.
KNOWN_CLEAR_ERRORS: set[str] = set()

#: Subsets of the models, one test each; a model's subset is ``shard(name)``.
SHARDS = 4

# (onnx, onnxruntime) -> models ORT CPU runs and matches per subset, out of the 1,884 with a
# data set (1521 in all).
ORT_RUNNABLE = {("1.23.2", "1.32.0"): (358, 392, 383, 388)}


def shard(name: str) -> int:
    """The subset of the model ``name``: a hash, so a model added to onnx moves no other."""
    return zlib.crc32(name.encode()) % SHARDS


def _session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def node_models() -> Iterator[tuple[str, onnx.ModelProto, list[np.ndarray], list[object]]]:
    """(name, model, inputs, expected outputs) of every node test with a data set."""
    yield from _node_models()


@functools.cache
def _node_models() -> list[tuple[str, onnx.ModelProto, list[np.ndarray], list[object]]]:
    # Generating them takes seconds: once per process, not once per subset.
    return list(_generate_node_models())


def _generate_node_models() -> Iterator[tuple[str, onnx.ModelProto, list[np.ndarray], list[object]]]:
    if NODE_DIR.is_dir():
        for model_path in sorted(glob.glob(str(NODE_DIR / "*" / "model.onnx"))):
            case = Path(model_path).parent
            ins = [
                numpy_helper.to_array(onnx.load_tensor(str(p)))
                for p in sorted(case.glob("test_data_set_0/input_*.pb"))
            ]
            outs = [
                numpy_helper.to_array(onnx.load_tensor(str(p)))
                for p in sorted(case.glob("test_data_set_0/output_*.pb"))
            ]
            yield case.name, onnx.load(model_path), ins, list(outs)
        return
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow on purpose (cast tests)
        cases = node.collect_testcases(None)
    for case in cases:
        if case.model is not None and case.data_sets:
            ins, outs = case.data_sets[0]
            yield case.name, case.model, list(ins), list(outs)


def ort_runs(model: onnx.ModelProto, ins: list[np.ndarray], outs: list[object]) -> bool:
    """ORT CPU runs the float32 model and roughly reproduces the stored outputs."""
    try:
        session = _session(model.SerializeToString())
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(ins):
            return False
        got = session.run(None, dict(zip(names, ins)))
    except Exception:  # noqa: BLE001 - ORT raises its own exception types
        return False
    for g, e in zip(got, outs):
        if not isinstance(e, np.ndarray) or e.dtype == object:
            continue
        if e.dtype.kind in "fc":
            if not np.allclose(
                np.asarray(g, np.float64),
                e.astype(np.float64),
                rtol=1e-2,
                atol=1e-3,
                equal_nan=True,
            ):
                return False
        elif not np.array_equal(g, e):
            return False
    return True


def check_conversion(name: str, data: bytes, policy: str | Policy, emulate: bool) -> str:
    """``valid`` or ``error: <message>``; raises AssertionError for anything else."""
    try:
        model = convert(onnx.load_from_string(data), policy, emulate=emulate)
    except MpgraphError as e:
        message = str(e)
        assert message and "\n" not in message, f"multi-line error: {message!r}"
        return f"{type(e).__name__}: {message}"
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(
            f"{type(e).__name__} instead of MpgraphError: {str(e)[:200]}"
        ) from None
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, strict_mode=True, check_type=True)
    if emulate or load_policy(policy).dtype == ir.DataType.FLOAT16:
        _session(proto.SerializeToString())
    return "valid"


@pytest.mark.slow
@pytest.mark.parametrize("subset", range(SHARDS), ids=lambda i: f"shard{i}of{SHARDS}")
def test_node_models_convert_or_fail_clearly(subset: int) -> None:
    start = time.perf_counter()
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    invalid: dict[str, list[str]] = collections.defaultdict(list)
    clear: set[str] = set()
    # Parsed once: the presets as convert would load them by name for every model.
    policies = {name: load_policy(name) for name in ("fp16", "bf16")}
    # fp16 native and emulated run the same float32 model for the range check: once here.
    with shared_range_checks():
        for name, model, ins, outs in node_models():
            if shard(name) != subset:
                continue
            counts["total"] += 1
            if not ort_runs(model, ins, outs):
                continue
            counts["ORT-runnable"] += 1
            data = model.SerializeToString()
            for policy in ("fp16", "bf16"):
                ok = True
                for emulate in (False, True):
                    variant = f"{policy} {'emulated' if emulate else 'native'}"
                    try:
                        outcome = check_conversion(name, data, policies[policy], emulate)
                    except Exception as e:  # noqa: BLE001 - collected, reported together below
                        failures.append(
                            f"{name} [{variant}]: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                        )
                        ok = False
                        continue
                    if outcome != "valid":
                        ok = False
                        if outcome.startswith(ValidationError.__name__):
                            invalid[name].append(f"{variant}: {outcome}")
                        else:
                            counts[f"clear errors {policy}"] += 1
                            clear.add(name)
                            reasons[
                                outcome.split(":")[0] + ": " + outcome.split(":", 2)[1].strip()[:60]
                            ] += 1
                if ok:
                    counts[f"valid {policy} (native + emulated)"] += 1
    print(f"\nnode models, subset {subset} of {SHARDS} ({time.perf_counter() - start:.0f} s):")
    for key, value in counts.items():
        print(f"  {key}: {value}")
    print(
        f"  invalid results caught by ValidationError: {len(invalid)} models ({sum(map(len, invalid.values()))} conversions)"
    )
    for reason, count in reasons.most_common():
        print(f"  clear error x{count}: {reason}")
    for name, lines in sorted(invalid.items()):
        print(f"  known invalid {name}: {lines[0][:150]}")
    # Failures first: a conversion that raised is also missing from the valid counts below.
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
    expected = ORT_RUNNABLE.get((onnx.__version__, ort.__version__))
    if expected is not None:
        assert counts["ORT-runnable"] == expected[subset], counts
    else:  # other versions: ORT's kernels differ; the table must still be about as large (1400 of 1884)
        assert counts["ORT-runnable"] > 0.74 * counts["total"], counts
    known_clear = {n for n in KNOWN_CLEAR_ERRORS if shard(n) == subset}
    assert clear == known_clear, f"clear-error set changed: {sorted(clear ^ known_clear)}"
    for policy in ("fp16", "bf16"):
        assert counts[f"valid {policy} (native + emulated)"] == counts["ORT-runnable"] - len(invalid) - len(clear)
    known_invalid = {n for n in KNOWN_INVALID if shard(n) == subset}
    assert set(invalid) == known_invalid, (
        f"ValidationError set changed: new {sorted(set(invalid) - known_invalid)}, "
        f"fixed {sorted(known_invalid - set(invalid))}"
    )
