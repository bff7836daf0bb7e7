"""Probing: the ONNX Runtime (CPU) runs the compiler and the audit make to look at numbers.

The compiler folds constants and measures activation ranges; the audit and the searches
(``tune``, ``advise-scale``) compare values. Each runs ORT on CPU, unoptimized, and reads
arrays back. Every such run goes through this module, so nothing outside ``mpgraph/runtime/``
imports onnxruntime, and the passes only read what a probe measured.

Example:
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    >>> node = ir.Node("", "Neg", [x], name="neg")
    >>> node.outputs[0].name = "y"
    >>> model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}), ir_version=8)
    >>> run(model, {"x": np.array([1.0, -2.0])})["y"].tolist()  # float64 feeds cast to float32
    [-1.0, 2.0]
    >>> measure_ranges(model, {"x": np.array([1e-9, -2.0], np.float32)}, ir.DataType.FLOAT16).ranges["y"]
    ValueRange(absmax=2.0, flushed=0.5)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mpgraph.dtypes import is_float, smallest_subnormal
from mpgraph.errors import DataError, MpgraphError, first_line

__all__ = [
    "MATERIALIZE_BYTES",
    "Calibration",
    "ValueRange",
    "cpu_session",
    "measure_ranges",
    "nchwc_block",
    "run",
    "run_with_values",
]

logger = logging.getLogger(__name__)

#: Activations up to this many bytes come back from ORT whole (fast); beyond, in-graph reductions.
MATERIALIZE_BYTES = 1 << 30

_ORT_FLOATS = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}


def cpu_session(
    model: ir.Model | onnx.ModelProto | bytes, *, log_severity: int = 4, threads: int | None = None
) -> ort.InferenceSession:
    """An unoptimized ORT CPU session, as every probe runs, made for one run.

    No graph optimization, so no fusion skips an emulation rounding, and a 10k-node graph's
    session is made in a third of the time. No weight prepacking and no spinning threads (both
    pay back over many runs); no value infos (ORT infers every type itself).

    Args:
        model: The model, as onnx-ir, protobuf or serialized bytes.
        log_severity: ORT's ``log_severity_level``; 4 (fatal only) because failures come
            back as one-line ``MpgraphError`` s.
        threads: ``intra_op_num_threads``; ORT's default (all cores) when None.

    Raises:
        MpgraphError: ORT cannot load the model (the first line of its message).
    """
    if isinstance(model, ir.Model):
        model = _ort_proto(model)
    if isinstance(model, onnx.ModelProto):
        model = _without_value_info(model)
    options = ort.SessionOptions()
    options.log_severity_level = log_severity
    if threads is not None:
        options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Every probe session runs once: packing MatMul weights ahead pays back only over many
    # runs, and idle threads spinning for the next tiny op steal the core the next op needs.
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise MpgraphError(f"ONNX Runtime (CPU) cannot load the model: {first_line(e)}") from None


def _ort_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` serialized for ORT, without value infos: ORT infers every type itself.

    ``ir.to_proto`` writes one value info per typed value: half its time on a 30k-node graph.
    """
    graph = model.graph
    shell = ir.GraphView(graph.inputs, graph.outputs, nodes=[], initializers=list(graph.initializers.values()),
                         opset_imports=dict(graph.opset_imports), name=graph.name)
    proto = ir.to_proto(ir.Model(shell, ir_version=model.ir_version, functions=list(model.functions.values())))  # type: ignore[arg-type]
    del proto.graph.value_info[:]
    for node in graph:
        ir.serde.serialize_node_into(proto.graph.node.add(), node, model_ir_version=model.ir_version)
    return proto


def _without_value_info(proto: onnx.ModelProto) -> bytes:
    """``proto`` serialized without its graph's value infos; ``proto`` is left as it was.

    ORT infers every type itself; reading them as well cost a 10k-node session a sixth of its time.
    """
    infos = onnx.GraphProto()
    infos.value_info.extend(proto.graph.value_info)
    del proto.graph.value_info[:]
    try:
        return proto.SerializeToString()
    finally:
        proto.graph.value_info.extend(infos.value_info)



def run(
    model: ir.Model | onnx.ModelProto, feeds: Mapping[str, np.ndarray], *, threads: int | None = None
) -> dict[str, np.ndarray]:
    """Run ``model`` once on ORT CPU (``cpu_session``) and return its outputs that are arrays.

    Float feeds are cast to the width of the input they feed (an ``.npz`` written from
    float64 numpy is the common case); feeds the model does not read are ignored.

    Raises:
        MpgraphError: ORT refuses the model or the run (the first line of its message).
        DataError: The feeds lack inputs (naming them, the keys given and the model's inputs).
    """
    session = cpu_session(model, threads=threads)
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
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise MpgraphError(f"ONNX Runtime (CPU) cannot run the model: {first_line(e)}") from None
    return {n: r for n, r in zip(names, results) if isinstance(r, np.ndarray)}


def _as_input_type(array: np.ndarray, ort_type: str) -> np.ndarray:
    target = _ORT_FLOATS.get(ort_type)
    array = np.asarray(array)
    if target is not None and array.dtype.kind == "f" and array.dtype != target:
        return array.astype(target)
    return array


def run_with_values(
    model: ir.Model, feeds: Mapping[str, np.ndarray], expose: Callable[[ir.Value], bool]
) -> dict[str, np.ndarray]:
    """``run`` ``model`` with every node output ``expose`` accepts made a graph output.

    Returns:
        Name -> array for the graph outputs and exposed values that came back as arrays.
    """
    proto = _ort_proto(model)
    present = {o.name for o in proto.graph.output}
    for node in model.graph:
        for value in node.outputs:
            if value.name and value.name not in present and expose(value):
                proto.graph.output.append(onnx.ValueInfoProto(name=value.name))
                present.add(value.name)
    return run(proto, feeds)


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """What one float32 value held on the calibration inputs.

    Attributes:
        absmax: Largest finite |x|: entries that are inf or NaN in float32 are so in any
            dtype, so they are no overflow of the low dtype.
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

    def absmax(self) -> dict[str, float]:
        """Value name -> largest |x| (what ``CalibrateRangePass`` records)."""
        return {name: r.absmax for name, r in self.ranges.items()}


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
        proto = _ort_proto(model)
    graph = proto.graph
    n_nodes, n_outputs = len(graph.node), len(graph.output)
    try:
        if opset < 9 or _activation_bytes(model, values, feeds) <= MATERIALIZE_BYTES:
            graph.output.extend(onnx.ValueInfoProto(name=v.name) for v in values if v.name)
            arrays = run(proto, feeds)
            ranges = {v.name: _range_of(arrays[v.name], low) for v in values if v.name in arrays}
        else:
            stats = _add_range_nodes(proto, {v.name: v.dtype for v in values if v.name}, low)  # type: ignore[misc]
            arrays = run(proto, feeds)
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
    # Two reductions decide the common case (all finite, none below ``tiny``); masks only when not.
    absmax = mag.max()
    if not np.isfinite(absmax):  # as _add_range_nodes: inf is no overflow
        absmax = np.where(np.isfinite(mag), mag, np.float32(0)).max()
    smallest = mag.min()
    flushed = 0 if smallest >= tiny else np.count_nonzero((mag > 0) & (mag < tiny))
    return ValueRange(float(absmax), float(flushed / mag.size))


def _add_range_nodes(
    proto: onnx.ModelProto, dtypes: Mapping[str, ir.DataType], low: ir.DataType
) -> dict[str, tuple[str, str]]:
    """Append ``absmax`` and ``flushed share`` nodes per value (name -> float dtype) to
    ``proto``'s graph, made outputs."""
    graph = proto.graph
    zero, tiny, big = "calib/zero", "calib/tiny", "calib/inf"
    # Constant nodes, not initializers: IR version 3 models must list initializers as inputs.
    nodes = [
        _node("Constant", [], zero, value=np.array(0.0, np.float32)),
        _node("Constant", [], tiny, value=np.array(smallest_subnormal(low) / 2, np.float32)),
        _node("Constant", [], big, value=np.array(np.inf, np.float32)),
    ]
    stats: dict[str, tuple[str, str]] = {}
    for i, (name, dtype) in enumerate(dtypes.items()):
        p = f"calib/{i}"
        mx, fl = f"{p}/absmax", f"{p}/flushed"
        x = name
        if dtype != ir.DataType.FLOAT:
            # The comparisons below take float32 constants: a float64 value (Adam's bias
            # corrections) against them is a type error that refuses the whole model. Rounded
            # to float32 first, as the materialized path does in numpy.
            x = f"{p}/float"
            nodes.append(_node("Cast", [name], x, to=ir.DataType.FLOAT.value))
        nodes += [
            _node("Abs", [x], f"{p}/abs"),
            # inf in float32 (a masked_fill's -inf) is inf in the low dtype too: no overflow.
            # (Less, not IsInf: opset 9 has no IsInf; Less(NaN, inf) is false as well.)
            _node("Less", [f"{p}/abs", big], f"{p}/is_finite"),
            _node("Where", [f"{p}/is_finite", f"{p}/abs", zero], f"{p}/finite"),
            _node("ReduceMax", [f"{p}/finite"], mx, keepdims=0),
            _node("Less", [f"{p}/abs", tiny], f"{p}/lt"),
            _node("Greater", [f"{p}/abs", zero], f"{p}/gt"),
            _node("And", [f"{p}/lt", f"{p}/gt"], f"{p}/and"),
            _node("Cast", [f"{p}/and"], f"{p}/f", to=ir.DataType.FLOAT.value),
            _node("ReduceMean", [f"{p}/f"], fl, keepdims=0),
        ]
        graph.output.extend([onnx.ValueInfoProto(name=mx), onnx.ValueInfoProto(name=fl)])
        stats[name] = (mx, fl)
    graph.node.extend(nodes)
    return stats


def _node(op_type: str, inputs: list[str], output: str, **attributes: int | np.ndarray) -> onnx.NodeProto:
    """One serialized default-domain node over values named ``inputs``; ints and arrays as attributes."""
    attrs = [ir.AttrInt64(k, v) if isinstance(v, int) else ir.AttrTensor(k, ir.tensor(v)) for k, v in attributes.items()]
    node = ir.Node("", op_type, [ir.Value(name=n) for n in inputs], attrs, outputs=[ir.Value(name=output)])
    return ir.serde.serialize_node(node)


def _nchwc_matches(block: int) -> bool:
    """Whether ORT's NCHWc Conv here computes a plain Conv once the lowering has moved it onto
    ``block``-channel blocks (``plan_session``'s ``nchwc`` rule: a 16-channel 3x3 layer against
    numpy)."""
    from mpgraph.lowering import PlanOptions, plan_session

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 5, 5)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    inputs = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(a.shape)) for n, a in (("x", x), ("w", w))]
    conv = ir.Node("", "Conv", inputs, [ir.AttrInt64s("kernel_shape", [3, 3])])
    conv.outputs[0].name = "y"
    conv.outputs[0].type, conv.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([2, 16, 3, 3])
    graph = ir.Graph(inputs, conv.outputs, nodes=[conv], opset_imports={"": 17})
    plan = plan_session(ir.Model(graph, ir_version=9), "cpu", PlanOptions(scope="native", nchwc_block=block))
    if dict(plan.applied).get("nchwc") != 1:  # not moved: the plain Conv would match anyway
        return False
    try:
        y = cpu_session(plan.graph).run(None, {"x": x, "w": w})[0]
    except Exception:  # noqa: BLE001 - no NCHWc kernels in this build or on this CPU
        return False
    cols = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))  # [2, 16, 3, 3, 3, 3]
    ref = np.einsum("nchwij,ocij->nohw", cols, w)
    return y.shape == ref.shape and bool(np.allclose(y, ref, rtol=1e-4, atol=1e-4))


@functools.cache
def nchwc_block() -> int:
    """ORT CPU's NCHWc channel block here: 16 with AVX-512, 8 with AVX2 (MLAS picks it at
    load time and ORT does not expose it, so each is tried on a one-layer probe once per
    process), 0 where ORT has no NCHWc kernels."""
    return next((b for b in (16, 8) if _nchwc_matches(b)), 0)
