"""The audit: what a converted model computes in which precision, and why."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph.dtypes import float_weight_bytes

__all__ = ["AuditReport", "audit"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Counts read from a converted model's metadata.

    Attributes:
        policy: Policy name recorded at conversion (``None`` if never converted).
        dtype: Target low dtype recorded at conversion.
        emulated: Whether the model is the CPU emulation.
        ops: ``role -> op_type -> precision -> count`` (role ``all`` for inference graphs).
        casts_inserted: Casts at policy boundaries that mpgraph inserted.
        rounds_inserted: Emulation rounding casts.
        casts_total: Every Cast node in the main graph.
        weight_bytes_before: Float weight bytes before conversion.
        weight_bytes_after: Float weight bytes now.
        reasons: ``reason -> count`` over decided nodes.
        initializer_range: Range events (overflow/underflow) recorded at conversion.
        nodes: Per-node records (name, op_type, role, precision, reason).
        loss_scaling: The policy's loss-scaling settings (``mpgraph.loss_scaling``) when the
            model is a training step graph that loss scaling rewrote, else ``None``.
        fp8: With fp8 products (``QuantizeFp8Pass``), else ``None``: ``recipe`` (the scaling
            settings and the recipe used), ``nodes`` (the quantisation's nodes, left out of
            ``ops`` and ``reasons``) and ``tensors``: per quantised tensor its ``format``,
            ``kind`` (forward or gradient), ``scale`` (its entry of the state input, ``None``
            when computed per run), ``scale_value`` (the value stored in the model: the initial one),
            ``history`` (length) and ``gemms`` (the products reading it).
    """

    policy: str | None
    dtype: str | None
    emulated: bool
    ops: dict[str, dict[str, dict[str, int]]]
    casts_inserted: int
    rounds_inserted: int
    casts_total: int
    weight_bytes_before: int | None
    weight_bytes_after: int
    reasons: dict[str, int]
    initializer_range: list[dict[str, Any]]
    nodes: list[dict[str, str]]
    loss_scaling: dict[str, Any] | None = None
    fp8: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def audit(model: ir.Model) -> AuditReport:
    """Summarise the precision decisions recorded in ``model``."""
    props = model.metadata_props
    ops: dict[str, dict[str, dict[str, int]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(int))
    )
    reasons: collections.Counter[str] = collections.Counter()
    nodes: list[dict[str, str]] = []
    casts = rounds = total_casts = fp8_nodes = 0
    for node in model.graph:
        inserted = node.metadata_props.get(md.NODE_INSERTED)
        if node.op_type == "Cast":
            total_casts += 1
        if inserted == "cast":
            casts += 1
            continue
        if inserted == "round":
            rounds += 1
            continue
        if inserted == "fp8":
            fp8_nodes += 1
            continue
        role = node.metadata_props.get(md.NODE_ROLE, "all")
        precision = node.metadata_props.get(md.NODE_PRECISION, "undecided")
        reason = node.metadata_props.get(md.NODE_REASON, "")
        ops[role][node.op_type][precision] += 1
        reasons[reason] += 1
        nodes.append(
            {"name": node.name or "", "op_type": node.op_type, "role": role, "precision": precision, "reason": reason}
        )
    before = props.get(md.MODEL_WEIGHT_BYTES_BEFORE)
    return AuditReport(
        policy=props.get(md.MODEL_POLICY),
        dtype=props.get(md.MODEL_DTYPE),
        emulated=props.get(md.MODEL_EMULATED) == "true",
        ops={r: {o: dict(p) for o, p in sorted(t.items())} for r, t in sorted(ops.items())},
        casts_inserted=casts,
        rounds_inserted=rounds,
        casts_total=total_casts,
        weight_bytes_before=int(before) if before is not None else None,
        weight_bytes_after=float_weight_bytes(model),
        reasons=dict(reasons.most_common()),
        initializer_range=json.loads(props.get(md.MODEL_INIT_RANGE, "[]")),
        nodes=nodes,
        loss_scaling=json.loads(props[md.MODEL_LOSS_SCALING]) if _loss_scaled(model) else None,
        fp8=_fp8_summary(model, fp8_nodes),
    )


def _loss_scaled(model: ir.Model) -> bool:
    """Whether loss scaling rewrote the step graph ``model`` (its contract has loss-scale
    state) and recorded its settings."""
    return (md.MODEL_LOSS_SCALING in model.metadata_props and StepContract.recorded(model)
            and StepContract.read(model).loss_scale is not None)


def _fp8_summary(model: ir.Model, nodes: int) -> dict[str, Any] | None:
    """``AuditReport.fp8`` from the ``mpgraph.fp8`` record and the state's stored values."""
    raw = model.metadata_props.get(md.MODEL_FP8)
    if raw is None:
        return None
    record = json.loads(raw)
    inits = model.graph.initializers
    tensors = {}
    for t in record["tensors"]:
        scales = inits.get(t["scale"]) if t["scale"] else None
        history = inits.get(t["history"]) if t["history"] else None
        stored = scales.const_value.numpy()[t["index"]] if scales is not None and scales.const_value is not None else None
        tensors[t["tensor"]] = {
            "format": t["format"], "kind": t["kind"], "scale": f"{t['scale']}[{t['index']}]" if t["scale"] else None,
            "scale_value": float(stored) if stored is not None else None,
            "history": int(history.shape[0]) if history is not None and history.shape is not None else None,
            "gemms": t["gemms"],
        }
    return {"recipe": record["recipe"], "nodes": nodes, "tensors": tensors}
