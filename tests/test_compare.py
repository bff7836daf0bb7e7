"""`compare` finds the first value where a converted model leaves the float32 one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import mpgraph
from mpgraph.audit import compare
from mpgraph.errors import MpgraphError

ALEXNET = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_bvlc_alexnet.onnx")


@pytest.fixture(scope="module")
def feeds():
    return {"data_0": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}


def test_first_divergence_names_the_overflowing_conv(feeds):
    """AlexNet's constant weights push activations past 65504: the first fp16 value to overflow is a Conv."""
    ref = mpgraph.load_model(ALEXNET)
    emu = mpgraph.convert(ALEXNET, "fp16", emulate=True, calibrate=None)  # the range check off
    report = compare(ref, emu, feeds)
    first = report.first_divergence
    assert first is not None and first.nonfinite > 0
    assert first.producer.startswith("Conv") and first.precision == "float16"
    # Every value before it in topological order stayed within the threshold.
    index = [v.name for v in report.values].index(first.name)
    assert all(v.rel_error <= report.threshold for v in report.values[:index])


def test_calibrated_conversion_does_not_diverge(feeds):
    ref = mpgraph.load_model(ALEXNET)
    emu = mpgraph.convert(ALEXNET, "fp16", emulate=True, calibrate=feeds)
    report = compare(ref, emu, feeds)
    assert report.first_divergence is None
    assert report.outputs and all(v.nonfinite == 0 for v in report.outputs)
    assert len(report.values) > 30


def test_native_bf16_on_cpu_is_a_clear_error(feeds):
    native = mpgraph.convert(ALEXNET, "bf16")
    with pytest.raises(MpgraphError, match="compare the --emulate conversion"):
        compare(mpgraph.load_model(ALEXNET), native, feeds)


def test_cli_compare(tmp_path):
    from tests.helpers import mpgraph_cli

    out = tmp_path / "alex.emu.onnx"
    mpgraph.convert_file(ALEXNET, out, "bf16", emulate=True)
    result = mpgraph_cli("compare", ALEXNET, str(out))
    assert result.returncode == 0, result.stderr
    assert "graph outputs" in result.stdout and "worst" in result.stdout


def test_cli_compare_prints_the_readme_line(tmp_path):
    """README's compare example, line for line: '[float16]' is text, not Rich markup to drop."""
    from tests.helpers import mpgraph_cli

    out = tmp_path / "alexnet.emu.onnx"
    converted = mpgraph_cli("convert", ALEXNET, "-p", "fp16", "--emulate", "--no-calibrate", "-o", str(out))
    assert converted.returncode == 0, converted.stderr
    result = mpgraph_cli("compare", ALEXNET, str(out))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("first divergence"))
    assert line == (
        "first divergence (rel error > 0.01, topological order): value 'r12' from Conv 'n12' [float16]: "
        "overflow, rel error inf, non-finite 36864, flushed to zero 0"
    )
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert line in readme


def test_relative_error_ignores_non_finite_reference_entries_without_a_warning():
    """An overflowed value (inf in both models at the same place, as in the AlexNet example)
    is compared on its finite entries only, and numpy's 'invalid value in subtract' warning
    (inf - inf) no longer reaches the user's terminal."""
    import warnings

    from mpgraph.audit.compare import relative_error

    ref = np.array([np.inf, 3.0, 4.0])
    cand = np.array([np.inf, 3.0, 4.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert relative_error(ref, cand) == pytest.approx(0.1)
