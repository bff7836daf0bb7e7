"""CalibrateRangePass: measure float32 activation ranges on sample inputs with ONNX Runtime."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph.dtypes import is_float
from mpgraph.errors import MpgraphError

__all__ = ["CalibrateRangePass", "ABSMAX_META", "random_feeds", "load_feeds", "run_with_values"]

logger = logging.getLogger(__name__)

#: ``value.meta`` key (in memory only) holding the largest finite |x| seen on calibration data.
ABSMAX_META = "mpgraph.absmax"


def random_feeds(model: ir.Model, seed: int = 0, batch: int = 2) -> dict[str, np.ndarray]:
    """Seeded sample inputs from the graph's input types; dynamic dims become ``batch``."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.inputs:
        if value.is_initializer() or value.dtype is None or value.shape is None or not value.name:
            continue
        shape = [d if isinstance(d, int) else batch for d in value.shape]
        np_dtype = value.dtype.numpy()
        if is_float(value.dtype):
            feeds[value.name] = rng.standard_normal(shape).astype(np_dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype=np_dtype)
    return feeds


def load_feeds(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Inputs from an ``.npz`` file keyed by input name."""
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise MpgraphError(f"{path}: cannot read calibration inputs ({e})") from None


class CalibrateRangePass(ir.passes.InPlacePass):
    """Runs the float32 graph on sample inputs and records each float value's max |x|.

    Rules:
        1. Every float value of the main graph is made an output of a copy of the model,
           which ONNX Runtime (CPU) runs once on ``feeds``.
        2. The largest finite absolute value lands in ``value.meta["mpgraph.absmax"]`` (never
           saved); ``AssignPrecisionPass`` keeps ops float32 whose compute values exceed the
           low dtype's range.
    """

    def __init__(self, feeds: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self.feeds = dict(feeds)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        values = {v.name: v for node in model.graph for v in node.outputs if v.name and is_float(v.dtype)}
        try:
            arrays = run_with_values(model, self.feeds, lambda v: v.name in values)
        except MpgraphError as e:
            raise MpgraphError(f"calibration run failed: {e}") from None
        for name, array in arrays.items():
            value = values.get(name)
            if value is None or array.size == 0:
                continue
            finite = np.abs(array[np.isfinite(array)].astype(np.float64))
            value.meta[ABSMAX_META] = float(finite.max()) if finite.size else 0.0
        return ir.passes.PassResult(model, False)


def run_with_values(
    model: ir.Model, feeds: Mapping[str, np.ndarray], expose: Callable[[ir.Value], bool]
) -> dict[str, np.ndarray]:
    """Run ``model`` once on ORT CPU with every node output ``expose`` accepts made a graph output.

    Returns:
        Name -> array for the graph outputs and exposed values that came back as arrays.

    Raises:
        MpgraphError: ORT refuses the model or the run (first line of its message).
    """
    import onnxruntime as ort

    proto = ir.to_proto(model)
    present = {o.name for o in proto.graph.output}
    for node in model.graph:
        for value in node.outputs:
            if value.name and value.name not in present and expose(value):
                proto.graph.output.append(onnx.ValueInfoProto(name=value.name))
                present.add(value.name)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        wanted = {i.name for i in session.get_inputs()}
        results = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MpgraphError(f"ONNX Runtime (CPU) cannot run the model: {first}") from None
    return {n: r for n, r in zip(names, results) if isinstance(r, np.ndarray)}
