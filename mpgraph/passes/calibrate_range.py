"""CalibrateRangePass: measure float32 activation ranges on sample inputs with ONNX Runtime.

Example:
    >>> from onnx import helper as h, TensorProto as T
    >>> g = h.make_graph([h.make_node("Gather", ["table", "ids"], ["y"])], "g",
    ...     [h.make_tensor_value_info("ids", T.INT64, [2, 3])], [h.make_tensor_value_info("y", T.FLOAT, None)],
    ...     [h.make_tensor("table", T.FLOAT, [5, 1], [0.0] * 5)])
    >>> ids = random_feeds(ir.from_proto(h.make_model(g)))["ids"]
    >>> bool(ids.min() >= 0 and ids.max() < 5)
    True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph.dtypes import is_float, smallest_subnormal
from mpgraph.errors import DataError, MpgraphError

__all__ = [
    "ABSMAX_META",
    "Calibration",
    "CalibrateRangePass",
    "ValueRange",
    "load_feeds",
    "measure_ranges",
    "random_feeds",
    "run_with_values",
]

logger = logging.getLogger(__name__)

#: ``value.meta`` key (in memory only) holding the largest |x| seen on calibration data.
ABSMAX_META = "mpgraph.absmax"

# Ops an integer input passes through unchanged on its way to a Gather index or a label.
_PASS_THROUGH = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"})
_LABEL_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_LENGTH_NAME = re.compile(r"(^|[_.\-/])(seq_?)?len(gth)?s?($|[_.\-/])", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """What one float32 value held on the calibration inputs.

    Attributes:
        absmax: Largest |x| (inf or NaN when the float32 value itself is not finite).
        flushed: Share of the entries that are nonzero but below half the low dtype's
            smallest subnormal, so they would round to zero in it.
    """

    absmax: float
    flushed: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Ranges of every float node output, and the float32 graph outputs, on one set of feeds.

    Attributes:
        feeds: The inputs the model ran on.
        ranges: Value name -> range.
        outputs: Graph output name -> float32 array.
        low: The dtype ``ValueRange.flushed`` refers to.
        source: Where the feeds came from (``random (seed 0)`` or a file), for messages.
    """

    feeds: Mapping[str, np.ndarray]
    ranges: Mapping[str, ValueRange]
    outputs: Mapping[str, np.ndarray]
    low: ir.DataType
    source: str = "given inputs"

    def flushing(self) -> list[tuple[str, ValueRange]]:
        """Values with entries that flush to zero in the low dtype, most affected first."""
        hits = [(n, r) for n, r in self.ranges.items() if r.flushed > 0]
        return sorted(hits, key=lambda item: (-item[1].flushed, item[0]))


def _int_bound(value: ir.Value) -> int | None:
    """Exclusive upper bound for an integer input: the rows of the table it indexes, or the classes it labels."""
    bounds: list[int] = []
    stack, seen = [value], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for use in current.uses():
            node, idx = use.node, use.idx
            if node.op_type in _PASS_THROUGH and idx == 0:
                stack.extend(node.outputs)
            elif node.op_type == "Gather" and idx == 1 and node.inputs[0] is not None:
                axis_attr = node.attributes.get("axis")
                axis = axis_attr.value if axis_attr is not None else 0
                shape = node.inputs[0].shape
                if shape is not None and -len(shape) <= axis < len(shape) and isinstance(shape[axis], int):
                    bounds.append(shape[axis])
            elif node.op_type in _LABEL_OPS and idx == 1 and node.inputs[0] is not None:
                shape = node.inputs[0].shape
                if shape is not None and len(shape) > 1 and isinstance(shape[1], int):
                    bounds.append(shape[1])
    return min(bounds) if bounds else None


def random_feeds(model: ir.Model, seed: int = 0, batch: int = 2) -> dict[str, np.ndarray]:
    """Seeded sample inputs that respect the model; dynamic dims become ``batch``.

    Float inputs are standard normal; integer inputs that index a table (``Gather``) or label
    classes (``SoftmaxCrossEntropyLoss``) are uniform over its rows or classes; inputs named
    like a mask are ones, like a length 1 (positive, and within any sequence); bool inputs are
    true; other integers are uniform in [0, 2).
    """
    rng = np.random.default_rng(seed)
    inputs = [
        v
        for v in model.graph.inputs
        if not v.is_initializer() and v.dtype is not None and v.shape is not None and v.name
    ]
    shapes = {v.name: [d if isinstance(d, int) else batch for d in v.shape] for v in inputs}  # type: ignore[union-attr]
    feeds: dict[str, np.ndarray] = {}
    for value in inputs:
        name = value.name or ""
        shape = shapes[name]
        np_dtype = value.dtype.numpy()  # type: ignore[union-attr]
        if value.dtype == ir.DataType.BOOL or _MASK_NAME.search(name):
            feeds[name] = np.ones(shape, dtype=np_dtype)
        elif is_float(value.dtype):
            feeds[name] = rng.standard_normal(shape).astype(np_dtype)
        elif _LENGTH_NAME.search(name):
            feeds[name] = np.ones(shape, dtype=np_dtype)
        else:
            high = _int_bound(value) or 2
            feeds[name] = rng.integers(0, max(high, 1), size=shape).astype(np_dtype)
    return feeds


def load_feeds(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Inputs from an ``.npz`` file keyed by input name."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read calibration inputs ({e})") from None


def _float_outputs(graph: ir.Graph) -> Iterator[ir.Value]:
    for node in graph:
        for value in node.outputs:
            if value.name and is_float(value.dtype):
                yield value


def measure_ranges(
    model: ir.Model,
    feeds: Mapping[str, np.ndarray],
    low: ir.DataType,
    *,
    source: str = "given inputs",
    proto: onnx.ModelProto | None = None,
) -> Calibration:
    """Run the float32 ``model`` once and reduce every float node output to a ``ValueRange``.

    Activations of at most ``MATERIALIZE_BYTES`` in all (estimated from the inferred shapes,
    symbolic dims taken as the largest feed dimension) come back from ONNX Runtime and are
    reduced in numpy, the fastest way. Larger ones are reduced inside the graph
    (``ReduceMax(Abs(x))`` and the share of entries that flush to zero, added to the
    serialized graph), so ORT frees each activation as usual and two scalars per value come
    back: 2-4x slower on the 10k-node benchmark, but memory stays that of one inference.
    Opsets below 9 (comparisons without float kernels) always materialize. ``proto``, if
    given, is ``ir.to_proto(model)`` made by the caller: it is used and left as it was.

    Raises:
        MpgraphError: ORT refuses the model or the feeds (names missing inputs and given keys).
    """
    values = [v for v in _float_outputs(model.graph) if not v.is_graph_output()]
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    outputs_wanted = [v.name for v in model.graph.outputs if v.name]
    if proto is None:
        proto = ir.to_proto(model)
    graph = proto.graph
    n_nodes, n_outputs = len(graph.node), len(graph.output)
    try:
        if opset < 9 or _activation_bytes(model, values, feeds) <= MATERIALIZE_BYTES:
            graph.output.extend(onnx.ValueInfoProto(name=v.name) for v in values if v.name)
            arrays = _run_proto(proto, feeds)
            ranges = {v.name: _range_of(arrays[v.name], low) for v in values if v.name in arrays}
        else:
            stats = _add_range_nodes(proto, [v.name for v in values if v.name], low)  # type: ignore[misc]
            arrays = _run_proto(proto, feeds)
            ranges = {
                name: ValueRange(float(arrays[mx]), float(arrays[fl]))
                for name, (mx, fl) in stats.items()
                if mx in arrays and fl in arrays
            }
    finally:
        del graph.node[n_nodes:]
        del graph.output[n_outputs:]
    for name in outputs_wanted:
        if name in arrays and arrays[name].dtype.kind == "f":
            ranges[name] = _range_of(arrays[name], low)
    for name, array in feeds.items():  # inputs are cast to the low dtype too
        ranges.setdefault(name, _range_of(np.asarray(array), low))
    outs = {n: arrays[n] for n in outputs_wanted if n in arrays}
    return Calibration(dict(feeds), ranges, outs, low, source)


#: Activations up to this many bytes come back from ORT whole (fast); beyond, in-graph reductions.
MATERIALIZE_BYTES = 1 << 30


def _activation_bytes(model: ir.Model, values: list[ir.Value], feeds: Mapping[str, np.ndarray]) -> float:
    """Estimated bytes of ``values`` on ``feeds``; inf when a shape is unknown.

    Symbolic dims take the size they have in the feeds (``batch`` -> 2); others the largest.
    """
    sizes: dict[str, int] = {}
    for value in model.graph.inputs:
        array = feeds.get(value.name or "")
        if array is None or value.shape is None or len(value.shape) != np.ndim(array):
            continue
        for dim, size in zip(value.shape, np.shape(array)):
            if not isinstance(dim, int):
                sizes[str(dim)] = size
    fill = max(sizes.values(), default=max((d for a in feeds.values() for d in np.shape(a)), default=1))
    total = 0.0
    for value in values:
        if value.shape is None:
            return float("inf")
        total += 4.0 * float(np.prod([d if isinstance(d, int) else sizes.get(str(d), fill) for d in value.shape]))
    return total


def _range_of(array: np.ndarray, low: ir.DataType) -> ValueRange:
    if array.size == 0 or array.dtype.kind != "f":
        return ValueRange(0.0, 0.0)
    mag = np.abs(array.astype(np.float32, copy=False))
    tiny = smallest_subnormal(low) / 2
    return ValueRange(float(mag.max()), float(((mag > 0) & (mag < tiny)).mean()))


def _add_range_nodes(proto: onnx.ModelProto, names: list[str], low: ir.DataType) -> dict[str, tuple[str, str]]:
    """Append ``absmax`` and ``flushed share`` nodes per value to ``proto``'s graph, made outputs."""
    graph = proto.graph
    helper = onnx.helper
    zero, tiny = "calib/zero", "calib/tiny"
    # Constant nodes, not initializers: IR version 3 models must list initializers as inputs.
    nodes = [
        helper.make_node("Constant", [], [zero], value=onnx.numpy_helper.from_array(np.array(0.0, np.float32))),
        helper.make_node(
            "Constant", [], [tiny], value=onnx.numpy_helper.from_array(np.array(smallest_subnormal(low) / 2, np.float32))
        ),
    ]
    stats: dict[str, tuple[str, str]] = {}
    for i, name in enumerate(names):
        p = f"calib/{i}"
        mx, fl = f"{p}/absmax", f"{p}/flushed"
        nodes += [
            helper.make_node("Abs", [name], [f"{p}/abs"]),
            helper.make_node("ReduceMax", [f"{p}/abs"], [mx], keepdims=0),
            helper.make_node("Less", [f"{p}/abs", tiny], [f"{p}/lt"]),
            helper.make_node("Greater", [f"{p}/abs", zero], [f"{p}/gt"]),
            helper.make_node("And", [f"{p}/lt", f"{p}/gt"], [f"{p}/and"]),
            helper.make_node("Cast", [f"{p}/and"], [f"{p}/f"], to=onnx.TensorProto.FLOAT),
            helper.make_node("ReduceMean", [f"{p}/f"], [fl], keepdims=0),
        ]
        graph.output.extend([onnx.ValueInfoProto(name=mx), onnx.ValueInfoProto(name=fl)])
        stats[name] = (mx, fl)
    graph.node.extend(nodes)
    return stats


class CalibrateRangePass(ir.passes.InPlacePass):
    """Records, per float value, the largest |x| it reached on calibration inputs.

    Rules:
        1. ``calibration`` is a ``Calibration`` (from ``measure_ranges``) or a mapping of
           inputs, measured here against ``low``.
        2. The largest |x| lands in ``value.meta["mpgraph.absmax"]`` (never saved);
           ``AssignPrecisionPass`` keeps ops float32 whose compute values exceed the low
           dtype's range / 2. Values are matched by name.
    """

    def __init__(self, calibration: Calibration | Mapping[str, np.ndarray], low: ir.DataType = ir.DataType.FLOAT16) -> None:
        super().__init__()
        self.calibration = calibration
        self.low = low

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        cal = self.calibration
        if not isinstance(cal, Calibration):
            try:
                cal = measure_ranges(model, cal, self.low)
            except MpgraphError as e:
                raise type(e)(f"calibration run failed: {e}") from None
        inputs = [v for v in model.graph.inputs if v.name and is_float(v.dtype)]
        for value in (*inputs, *_float_outputs(model.graph)):
            found = cal.ranges.get(value.name or "")
            if found is not None:
                absmax = found.absmax
                value.meta[ABSMAX_META] = float("inf") if np.isnan(absmax) else absmax
        return ir.passes.PassResult(model, False)


def _run_proto(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures come back as one-line MpgraphErrors
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise MpgraphError(f"ONNX Runtime (CPU) cannot load the model: {_first_line(e)}") from None
    wanted = {i.name: i for i in session.get_inputs()}
    missing = sorted(set(wanted) - set(feeds))
    if missing:
        raise DataError(
            f"inputs {missing} are missing from the feeds; the feeds have "
            + (", ".join(repr(k) for k in sorted(feeds)) if feeds else "no arrays")
            + f"; the model's inputs are {sorted(wanted)}"
        )
    typed = {k: _as_input_type(v, wanted[k].type) for k, v in feeds.items() if k in wanted}
    names = [o.name for o in session.get_outputs()]
    try:
        results = session.run(names, typed)
    except Exception as e:  # noqa: BLE001
        raise MpgraphError(f"ONNX Runtime (CPU) cannot run the model: {_first_line(e)}") from None
    return {n: r for n, r in zip(names, results) if isinstance(r, np.ndarray)}


_ORT_FLOATS = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}


def _as_input_type(array: np.ndarray, ort_type: str) -> np.ndarray:
    # An .npz written from float64 numpy is the common case: cast floats to the input's width.
    target = _ORT_FLOATS.get(ort_type)
    array = np.asarray(array)
    if target is not None and array.dtype.kind == "f" and array.dtype != target:
        return array.astype(target)
    return array


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def run_with_values(
    model: ir.Model, feeds: Mapping[str, np.ndarray], expose: Callable[[ir.Value], bool]
) -> dict[str, np.ndarray]:
    """Run ``model`` once on ORT CPU with every node output ``expose`` accepts made a graph output.

    Returns:
        Name -> array for the graph outputs and exposed values that came back as arrays.

    Raises:
        MpgraphError: ORT refuses the model or the run (first line of its message), or the
            feeds lack inputs (naming them and the keys given).
    """
    proto = ir.to_proto(model)
    present = {o.name for o in proto.graph.output}
    for node in model.graph:
        for value in node.outputs:
            if value.name and value.name not in present and expose(value):
                proto.graph.output.append(onnx.ValueInfoProto(name=value.name))
                present.add(value.name)
    return _run_proto(proto, feeds)
