"""CalibrateRangePass: record the float32 activation ranges a probe measured on sample inputs.

The measuring (a float32 run on ONNX Runtime) is ``mpgraph.runtime.probe.measure_ranges``;
this pass only writes its result where ``AssignPrecisionPass`` reads it.

Example:
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    >>> node = ir.Node("", "Exp", [x], name="exp")
    >>> node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    >>> model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}), ir_version=8)
    >>> CalibrateRangePass({"x": 3.0, "y": float("nan")})(model).modified
    False
    >>> x.meta[ABSMAX_META], node.outputs[0].meta[ABSMAX_META]
    (3.0, inf)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import onnx_ir as ir

from mpgraph.dtypes import is_float

__all__ = ["ABSMAX_META", "CalibrateRangePass"]

#: ``value.meta`` key (in memory only) holding the largest |x| seen on calibration data.
ABSMAX_META = "mpgraph.absmax"


class CalibrateRangePass(ir.passes.InPlacePass):
    """Records, per float value, the largest |x| it reached on calibration inputs.

    Rules:
        1. ``absmax`` maps value names to the largest |x| measured in float32
           (``Calibration.absmax()`` of ``mpgraph.runtime.probe.measure_ranges``). Float
           graph inputs and float node outputs are matched by name; others are left alone.
        2. The largest |x| lands in ``value.meta["mpgraph.absmax"]`` (never saved);
           ``AssignPrecisionPass`` keeps ops float32 whose compute values exceed the low
           dtype's range / 2.
        3. NaN (the float32 value itself is not finite) is recorded as inf.
        4. The model itself is unchanged: ``modified`` is False.
    """

    def __init__(self, absmax: Mapping[str, float]) -> None:
        super().__init__()
        self.absmax = absmax

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        values = [v for v in model.graph.inputs if v.name and is_float(v.dtype)]
        values += [v for node in model.graph for v in node.outputs if v.name and is_float(v.dtype)]
        for value in values:
            found = self.absmax.get(value.name or "")
            if found is not None:
                value.meta[ABSMAX_META] = float("inf") if math.isnan(found) else found
        return ir.passes.PassResult(model, False)
