"""mpgraph.runtime.probe: the ORT CPU runs the compiler and the audit make, and what they return."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from mpgraph.errors import DataError, MpgraphError
from mpgraph.runtime import probe
from mpgraph.runtime.probe import (
    Calibration,
    ValueRange,
    cpu_session,
    measure_ranges,
    run,
    run_with_values,
)


def _model(opset: int = 17) -> onnx.ModelProto:
    """y = Exp(x) * 1e-9; z = Neg(y): two float node outputs, one intermediate."""
    nodes = [
        h.make_node("Exp", ["x"], ["e"], name="exp"),
        h.make_node("Mul", ["e", "tiny"], ["y"], name="mul"),
        h.make_node("Neg", ["y"], ["z"], name="neg"),
    ]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("z", T.FLOAT, [2, 3])],
        [h.make_tensor("tiny", T.FLOAT, [], [1e-9])],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _typed(proto: onnx.ModelProto) -> ir.Model:
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5


@pytest.mark.parametrize("form", ["ir", "proto", "bytes"])
def test_cpu_session_takes_every_model_form(form: str) -> None:
    proto = _model()
    model = {"ir": ir.from_proto(proto), "proto": proto, "bytes": proto.SerializeToString()}[form]
    session = cpu_session(model)
    (z,) = session.run(None, {"x": X})
    np.testing.assert_allclose(z, -np.exp(X) * np.float32(1e-9), rtol=1e-6)
    assert session.get_session_options().graph_optimization_level.name == "ORT_DISABLE_ALL"


def test_cpu_session_refuses_in_one_line() -> None:
    bad = _model()
    bad.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(MpgraphError, match=r"^ONNX Runtime \(CPU\) cannot load the model: [^\n]*$"):
        cpu_session(bad)


def test_run_casts_float_feeds_and_ignores_extra_ones() -> None:
    out = run(_model(), {"x": X.astype(np.float64), "unused": np.zeros(1)})
    assert set(out) == {"z"} and out["z"].dtype == np.float32
    np.testing.assert_allclose(out["z"], -np.exp(X) * np.float32(1e-9), rtol=1e-6)


def test_run_names_missing_inputs_given_keys_and_model_inputs() -> None:
    with pytest.raises(DataError, match=r"inputs \['x'\] are missing from the feeds; the feeds have 'w'; "
                                        r"the model's inputs are \['x'\]"):
        run(_model(), {"w": X})
    with pytest.raises(DataError, match="the feeds have no arrays"):
        run(_model(), {})


def test_run_reports_a_failing_run_in_one_line() -> None:
    with pytest.raises(MpgraphError, match=r"^ONNX Runtime \(CPU\) cannot run the model: "):
        run(_model(), {"x": np.zeros((2, 4), np.float32)})  # shape [2, 3] declared


def test_run_with_values_exposes_only_what_is_asked() -> None:
    model = ir.from_proto(_model())
    out = run_with_values(model, {"x": X}, lambda v: v.name == "e")
    assert set(out) == {"e", "z"}
    np.testing.assert_allclose(out["e"], np.exp(X), rtol=1e-6)
    assert [v.name for v in model.graph.outputs] == ["z"]  # the model is not changed



def test_measure_ranges_reads_every_float_value_the_feeds_and_outputs() -> None:
    model = _typed(_model())
    cal = measure_ranges(model, {"x": X}, ir.DataType.FLOAT16, source="test")
    assert set(cal.ranges) == {"x", "e", "y", "z"}
    assert cal.ranges["e"].absmax == pytest.approx(np.exp(2.5), rel=1e-6) and cal.ranges["e"].flushed == 0.0
    # e * 1e-9 is at most 1.2e-8, below half fp16's smallest subnormal (3e-8): every entry flushes.
    assert cal.ranges["y"].flushed == 1.0
    assert cal.ranges["x"].absmax == 2.5 and cal.low == ir.DataType.FLOAT16 and cal.source == "test"
    np.testing.assert_allclose(cal.outputs["z"], -np.exp(X) * np.float32(1e-9), rtol=1e-6)
    assert cal.absmax() == {name: r.absmax for name, r in cal.ranges.items()}
    assert [name for name, _ in cal.flushing()] == ["y", "z"]  # same share: by name


def test_in_graph_reduction_gives_the_materialized_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _typed(_model())
    proto = ir.to_proto(model)
    before = proto.SerializeToString()
    materialized = measure_ranges(model, {"x": X}, ir.DataType.FLOAT16, proto=proto)
    monkeypatch.setattr(probe, "MATERIALIZE_BYTES", 0)
    reduced = measure_ranges(model, {"x": X}, ir.DataType.FLOAT16, proto=proto)
    assert proto.SerializeToString() == before  # the caller's proto is left as it was
    assert set(reduced.ranges) == set(materialized.ranges)
    for name, r in materialized.ranges.items():
        assert reduced.ranges[name].absmax == pytest.approx(r.absmax, rel=1e-6)
        assert reduced.ranges[name].flushed == pytest.approx(r.flushed)


def test_in_graph_reduction_takes_float64_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step graph's Adam bias corrections are float64; compared with float32 constants, ORT refused the model."""
    nodes = [
        h.make_node("Cast", ["x"], ["x64"], to=T.DOUBLE),
        h.make_node("Mul", ["x64", "tiny"], ["y64"], name="mul"),
        h.make_node("Cast", ["y64"], ["y"], to=T.FLOAT),
        h.make_node("Neg", ["y"], ["z"], name="neg"),
    ]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("z", T.FLOAT, [2, 3])],
        [h.make_tensor("tiny", T.DOUBLE, [], [1e-9])],
    )
    model = _typed(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    materialized = measure_ranges(model, {"x": X}, ir.DataType.FLOAT16)
    monkeypatch.setattr(probe, "MATERIALIZE_BYTES", 0)
    reduced = measure_ranges(model, {"x": X}, ir.DataType.FLOAT16)
    assert {"x64", "y64"} <= set(reduced.ranges) and reduced.ranges["y64"].flushed > 0
    for name, r in materialized.ranges.items():
        assert reduced.ranges[name].absmax == pytest.approx(r.absmax, rel=1e-6)
        assert reduced.ranges[name].flushed == pytest.approx(r.flushed)


def test_flushing_orders_by_share_then_name() -> None:
    cal = Calibration({}, {"b": ValueRange(1, 0.5), "a": ValueRange(1, 0.5), "c": ValueRange(1, 0.9),
                           "d": ValueRange(1, 0.0)}, {}, ir.DataType.FLOAT16)
    assert [n for n, _ in cal.flushing()] == ["c", "a", "b"]
