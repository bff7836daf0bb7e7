"""`compare` finds the first value where a converted model leaves the float32 one."""

from __future__ import annotations

import os
import subprocess
import sys

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
    out = tmp_path / "alex.emu.onnx"
    mpgraph.convert_file(ALEXNET, out, "bf16", emulate=True)
    result = subprocess.run([sys.executable, "-m", "mpgraph", "compare", ALEXNET, str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "graph outputs" in result.stdout and "worst" in result.stdout
