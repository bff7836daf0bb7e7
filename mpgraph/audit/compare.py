"""Where do a converted model's numbers leave the float32 model's? Value by value.

Both models run once in ONNX Runtime (CPU) on the same inputs with every float intermediate
value exposed as an output; values are matched by name (mpgraph keeps the names of the values
it lowers), and each gets a relative error. The first value in the candidate's topological
order whose error crosses the threshold is where the divergence starts: no more bisecting by
hand for the node that turned fp16 outputs into NaN.

Each divergence gets a kind: ``overflow`` (the candidate is inf/NaN where float32 is finite),
``underflow`` (most of the error sits in entries the candidate flushed to zero while float32's
are nonzero) or ``rounding`` (everything else). A native model the CPU provider has no kernel
for is refused before ORT fails (``mpgraph.targets.check_runnable``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.data import check_inputs, random_feeds, read_npz
from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import MpgraphError
from mpgraph.runtime.probe import run_with_values
from mpgraph.targets import check_runnable

__all__ = ["ValueDivergence", "CompareReport", "compare", "match_value", "relative_error", "run_all"]


@dataclasses.dataclass(frozen=True)
class ValueDivergence:
    """Error of one value of the candidate against the reference.

    Attributes:
        name: Value name.
        producer: ``op_type 'node name'`` of the candidate's producer.
        precision: The producer's recorded precision.
        rel_error: ``||cand - ref|| / ||ref||`` over finite reference entries.
        max_abs_error: Largest absolute difference.
        nonfinite: Entries that are inf/NaN in the candidate but finite in the reference.
        kind: ``overflow``, ``underflow``, ``rounding``, or ``exact`` (no error).
        flushed: Entries that are zero in the candidate but nonzero in the reference.
    """

    name: str
    producer: str
    precision: str
    rel_error: float
    max_abs_error: float
    nonfinite: int
    kind: str = "rounding"
    flushed: int = 0


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """Outputs and intermediate values compared, in the candidate's topological order."""

    outputs: list[ValueDivergence]
    values: list[ValueDivergence]
    threshold: float
    first_divergence: ValueDivergence | None
    notes: list[str] = dataclasses.field(default_factory=list)

    def worst(self, k: int = 10) -> list[ValueDivergence]:
        return sorted(self.values, key=lambda v: (v.nonfinite, v.rel_error), reverse=True)[:k]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def run_all(model: ir.Model, feeds: Mapping[str, np.ndarray], *, with_bool: bool = False,
            what: str = "model") -> dict[str, np.ndarray]:
    """Run ``model`` on ORT CPU with every float value (and bool ones, ``with_bool``) exposed.

    Raises:
        MpgraphError: ORT failed; for a native bfloat16 ``what``, the message points to
            ``--emulate``.
    """
    def expose(value: ir.Value) -> bool:
        # Untyped values (no value_info in the file) are exposed too; numpy reads no bfloat16, and
        # the fp8 operands come back as raw bytes or not at all (their float32 values are compared).
        return (value.dtype is None or (value.dtype in FLOAT_TYPES and value.dtype != ir.DataType.BFLOAT16)
                or (with_bool and value.dtype == ir.DataType.BOOL))

    try:
        return run_with_values(model, feeds, expose)
    except MpgraphError as e:
        props = model.metadata_props
        if props.get(md.MODEL_DTYPE) == "bfloat16" and props.get(md.MODEL_EMULATED) != "true":
            raise MpgraphError(f"{e} (a native bfloat16 {what} cannot run on ORT CPU: compare the --emulate conversion)") from None
        raise


def relative_error(ref: np.ndarray, cand: np.ndarray) -> float:
    """``||cand - ref|| / ||ref||``; ``inf`` when the candidate is non-finite where ``ref`` is finite.

    Example:
        >>> relative_error(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
        0.1
        >>> relative_error(np.array([1.0]), np.array([np.inf]))
        inf
    """
    r = ref.astype(np.float64)
    c = cand.astype(np.float64)
    finite = np.isfinite(r)
    if (finite & ~np.isfinite(c)).any():
        return float("inf")
    norm = float(np.linalg.norm(r[finite]))
    diff = float(np.linalg.norm(c[finite] - r[finite]))  # inf - inf outside `finite` never computed
    return diff / norm if norm > 0 else float(diff > 0)


def match_value(name: str, ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray]) -> tuple[str, str] | None:
    """(reference name, candidate name) of a candidate value, or None when either has none.

    A lowered graph output is computed under ``<name>_<bf16|fp16>`` (emulated:
    ``<name>_unrounded``), and an emulated graph holds a low value rounded as ``round/<name>``.

    Example:
        >>> match_value("y_bf16", {"y": 0}, {"y_bf16": 0, "round/y_bf16": 0})
        ('y', 'round/y_bf16')
    """
    base = name
    for suffix in ("_bf16", "_fp16", "_unrounded"):
        if base not in ref and base.endswith(suffix):
            base = base[: -len(suffix)]
    held = f"round/{name}" if f"round/{name}" in cand else name
    return (base, held) if base in ref and held in cand else None


def _error(name: str, ref: np.ndarray, cand: np.ndarray, producer: str, precision: str) -> ValueDivergence | None:
    if ref.shape != cand.shape or ref.dtype.kind != "f" or cand.dtype.kind != "f":
        return None
    r = ref.astype(np.float64)
    c = cand.astype(np.float64)
    finite = np.isfinite(r)
    both = finite & np.isfinite(c)
    nonfinite = int((finite & ~np.isfinite(c)).sum())
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where both overflowed
        diff = np.where(both, c - r, 0.0)
    norm = float(np.linalg.norm(np.where(finite, r, 0.0)))
    total = float(np.linalg.norm(diff))
    rel = total / norm if norm > 0 else float(total > 0)
    flushed_mask = both & (c == 0) & (r != 0)
    flushed = int(flushed_mask.sum())
    if nonfinite:
        rel, kind = float("inf"), "overflow"
    elif total == 0:
        kind = "exact"
    elif flushed and float(np.linalg.norm(diff[flushed_mask])) >= 0.5 * total:
        kind = "underflow"
    else:
        kind = "rounding"
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    return ValueDivergence(name, producer, precision, rel, max_abs, nonfinite, kind, flushed)


def compare(
    reference: ir.Model,
    candidate: ir.Model,
    feeds: Mapping[str, np.ndarray] | str | os.PathLike | None = None,
    *,
    threshold: float = 1e-2,
    seed: int = 0,
) -> CompareReport:
    """Compare ``candidate`` (e.g. an emulated conversion) with ``reference`` value by value.

    Args:
        reference: The float32 model.
        candidate: The converted model (emulated, or native float16).
        feeds: Inputs (mapping or ``.npz``); seeded random inputs when ``None``.
        threshold: Relative error at which a value counts as diverged.
        seed: Seed of the random inputs.
    """
    try:
        notes = check_runnable(candidate, "cpu")
    except MpgraphError as e:
        raise MpgraphError(f"{e}, or compare the --emulate conversion") from None
    if feeds is None:
        inputs = random_feeds(reference, seed=seed)
    elif isinstance(feeds, (str, os.PathLike)):
        inputs = read_npz(feeds)
        check_inputs(inputs, str(feeds))
    else:
        inputs = dict(feeds)
        check_inputs(inputs, "inputs")
    ref = run_all(reference, inputs)
    cand = run_all(candidate, inputs)
    values: list[ValueDivergence] = []
    for node in candidate.graph:
        if node.metadata_props.get(md.NODE_INSERTED):
            continue
        label = f"{node.op_type} '{node.name}'"
        precision = node.metadata_props.get(md.NODE_PRECISION, "?")
        for value in node.outputs:
            match = match_value(value.name or "", ref, cand)
            if match is not None:
                err = _error(match[0], ref[match[0]], cand[match[1]], label, precision)
                if err is not None:
                    values.append(err)
    outputs = []
    for out_ref, out_cand in zip(reference.graph.outputs, candidate.graph.outputs):
        if out_ref.name in ref and out_cand.name in cand:
            err = _error(out_ref.name, ref[out_ref.name], cand[out_cand.name], "graph output", "-")
            if err is not None:
                outputs.append(err)
    first = next((v for v in values if v.rel_error > threshold), None)
    return CompareReport(outputs, values, threshold, first, notes)
