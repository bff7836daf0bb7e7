"""How the fp8 operands of one run fared: saturated and flushed entries per quantised tensor.

``QuantizeFp8Pass`` records, on each product, the value holding an operand's fp8 bits; its
producer reads the scaled float32 operand ``x * s`` and its reader widens the fp8 value back.
From a run with those values exposed (``compare``'s), per tensor: the share of entries that
saturate (``|x * s|`` above the format's largest finite value, or inf) and that flush to zero
(nonzero ``x * s``, zero fp8 value), and the scale the run used.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md

__all__ = ["Fp8TensorStats", "fp8_stats"]

_MAX = {"float8e4m3fn": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
        "float8e5m2": float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}


@dataclasses.dataclass(frozen=True)
class Fp8TensorStats:
    """One quantised tensor in one run.

    Attributes:
        tensor: The tensor (``mpgraph.fp8``'s key).
        format: Its fp8 format.
        scale: The scale the run used (the first operand's; ``nan`` when not exposed).
        entries: Entries quantised, over every operand of the tensor.
        saturated: Share of them beyond the format's largest finite value.
        flushed: Share of them nonzero but zero in fp8.
    """

    tensor: str
    format: str
    scale: float
    entries: int
    saturated: float
    flushed: float


def _operands(model: ir.Model) -> dict[str, list[tuple[str, str, str]]]:
    """Tensor -> the ``(scaled, widened, scale)`` value names of each of its quantised operands."""
    producers = {v.name: n for n in model.graph for v in n.outputs if v.name}
    readers: dict[str, str] = {}
    for node in model.graph:
        if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None and node.inputs[0].name:
            readers.setdefault(node.inputs[0].name, node.outputs[0].name or "")
    found: dict[str, list[tuple[str, str, str]]] = {}
    for node in model.graph:
        for slot in json.loads(node.metadata_props.get(md.NODE_FP8, "{}")).values():
            cast = producers.get(slot["fp8"])
            if cast is None or not cast.inputs or cast.inputs[0] is None or slot["fp8"] not in readers:
                continue
            scaled = cast.inputs[0]
            mul = scaled.producer()
            scale = mul.inputs[1] if mul is not None and len(mul.inputs) > 1 and mul.inputs[1] is not None else None
            pair = (scaled.name or "", readers[slot["fp8"]], scale.name or "" if scale is not None else "")
            if pair not in found.setdefault(slot["tensor"], []):
                found[slot["tensor"]].append(pair)
    return found


def fp8_stats(model: ir.Model, arrays: Mapping[str, np.ndarray]) -> list[Fp8TensorStats]:
    """Per quantised tensor of ``model`` (in ``mpgraph.fp8`` order), from a run's ``arrays``
    (value name -> array, with the scaled and widened operands exposed); empty without fp8."""
    raw = model.metadata_props.get(md.MODEL_FP8)
    if raw is None:
        return []
    operands = _operands(model)
    stats = []
    for record in json.loads(raw)["tensors"]:
        found = [o for o in operands.get(record["tensor"], []) if o[0] in arrays and o[1] in arrays]
        if not found:
            continue
        pairs = [(arrays[s], arrays[w]) for s, w, _ in found]
        top = _MAX[record["format"]]
        entries = sum(s.size for s, _ in pairs)
        saturated = sum(int((np.abs(s) > top).sum()) for s, _ in pairs)
        flushed = sum(int(((s != 0) & ~np.isnan(s) & (w == 0)).sum()) for s, w in pairs)
        scale = arrays.get(found[0][2])
        stats.append(Fp8TensorStats(record["tensor"], record["format"],
                                    float(scale) if scale is not None else float("nan"), entries,
                                    saturated / entries if entries else 0.0, flushed / entries if entries else 0.0))
    return stats
