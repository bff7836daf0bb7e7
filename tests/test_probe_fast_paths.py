"""The range check's shortcuts decide as the long way did.

Probes serialize without value infos, leave a proto they are given as it was, reduce arrays
with two reductions when no entry is special, and the finite check emulates a clone of the
converted model: each shortcut must leave values, ranges and the model itself unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mpgraph
from mpgraph.passes.emulate_precision import EmulatePrecisionPass
from mpgraph.runtime import probe
from mpgraph.runtime.probe import ValueRange, measure_ranges, run_with_values
from tests.helpers import h, make_model, mlp_model, vi

X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5


def test_a_probe_leaves_the_proto_it_was_given_as_it_was() -> None:
    proto = onnx.shape_inference.infer_shapes(mlp_model())
    assert len(proto.graph.value_info) == 5
    before = proto.SerializeToString()
    out = probe.run(proto, {"x": np.ones((2, 4), np.float32)})
    assert out["y"].shape == (2, 3)
    assert proto.SerializeToString() == before


def test_an_ir_model_runs_as_its_proto_does_functions_included() -> None:
    twice = h.make_function("local", "Twice", ["a"], ["b"], [h.make_node("Add", ["a", "a"], ["b"])],
                            [h.make_opsetid("", 18)])
    nodes = [h.make_node("Twice", ["x"], ["t"], domain="local", name="twice"), h.make_node("Exp", ["t"], ["y"], name="exp")]
    proto = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    proto.functions.append(twice)
    proto.opset_import.append(h.make_opsetid("local", 1))
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    got = run_with_values(model, {"x": X}, lambda v: True)
    assert set(got) == {"t", "y"}
    np.testing.assert_array_equal(got["t"], X + X)
    np.testing.assert_array_equal(got["y"], probe.run(proto, {"x": X})["y"])


@pytest.mark.parametrize("in_graph", [False, True], ids=["numpy", "in-graph"])
def test_ranges_of_inf_nan_zero_and_tiny_entries(monkeypatch: pytest.MonkeyPatch, in_graph: bool) -> None:
    if in_graph:
        monkeypatch.setattr(probe, "MATERIALIZE_BYTES", 0)
    nodes = [h.make_node("Div", ["x", "d"], ["y"], name="div"), h.make_node("Neg", ["y"], ["z"], name="neg")]
    proto = make_model(nodes, [vi("x", [8]), vi("d", [8])], [vi("z", [8])])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    x = np.array([1, -1, 0, 1e-9, -2e-8, 5, 0, 3], np.float32)
    d = np.array([0, 0, 0, 1, 1, 1, 2, 1], np.float32)  # y: inf, -inf, NaN, two below 2**-25, 5, 0, 3
    ranges = measure_ranges(model, {"x": x, "d": d}, ir.DataType.FLOAT16).ranges
    # The largest finite |y| is 5; 1e-9 and 2e-8 flush in float16 (zeros, inf and NaN do not).
    assert ranges["y"] == ranges["z"] == ranges["x"] == ValueRange(5.0, 0.25)
    assert ranges["d"] == ValueRange(2.0, 0.0)
    assert type(ranges["y"].absmax) is float and type(ranges["x"].flushed) is float


def test_emulating_a_clone_leaves_the_converted_model_as_it_was() -> None:
    native = mpgraph.convert(mlp_model(), "fp16", calibrate=None)
    before = ir.to_proto(native).SerializeToString()
    view = native.clone()
    EmulatePrecisionPass(ir.DataType.FLOAT16)(view)
    assert ir.to_proto(native).SerializeToString() == before
    assert native.graph.node("allow1").outputs[0].dtype == ir.DataType.FLOAT16
    assert view.graph.node("allow1").outputs[0].dtype == ir.DataType.FLOAT
