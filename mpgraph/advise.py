"""``mpgraph advise-scale``: which loss scale, measured on a few float32 batches.

The float32 step graph runs on each batch with every backward value that the policy would hold
in the low dtype exposed (a backward op the policy lowers, or a backward value cast to the low
dtype at a policy boundary). Backward values are linear in the loss's gradient seed, so under
a loss scale S each is S times its float32 value. For every such tensor and every candidate
scale (powers of two, 1 to 2**24) ``advise_scale`` reports:

* the **flush share**: nonzero entries whose scaled magnitude is below half the low dtype's
  smallest subnormal (float16: 2**-25, about 3e-8), which round to zero;
* the **subnormal share**: entries below the smallest normal (float16: 6.1e-5), which keep
  fewer mantissa bits;
* the **overflow margin**: the low dtype's largest finite value over the largest scaled
  magnitude (below 1: the tensor overflows to inf).

Recommendation, phase by phase:

1. **Underflow bound.** The smallest candidate scale at which the flush share over all
   tensors is at most ``max_flush`` (e.g. gradients of 1e-8 need S >= 2**3 to reach 3e-8, and
   more to leave the subnormals).
2. **Overflow bound.** The largest candidate scale whose overflow margin is at least
   ``headroom`` on every batch (gradients grow and shrink during training; the headroom keeps
   the first steps from overflowing).
3. **Scale.** The overflow bound, the largest safe scale (fewest values lost to underflow),
   when it is at least the underflow bound.
4. **Dynamic or static.** Dynamic scaling is needed when no candidate meets both bounds on
   every batch, or when the window between them is narrower than ``2**min_window_bits``
   (training will drift out of it); otherwise a static scale works on these batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph.data import check_inputs
from mpgraph.dtypes import finite_max, is_float, smallest_subnormal
from mpgraph.errors import MpgraphError
from mpgraph.io import as_model
from mpgraph.policy import Policy, load_policy
from mpgraph.runtime.probe import run_with_values

__all__ = ["TensorScaleStats", "ScaleAdvice", "advise_scale", "low_backward_values", "scale_label", "CANDIDATE_SCALES"]

#: Powers of two from 1 to 2**24 (GradScaler's bounds are 1 and 2**24 here too).
CANDIDATE_SCALES: tuple[float, ...] = tuple(float(2**k) for k in range(25))


@dataclasses.dataclass(frozen=True)
class TensorScaleStats:
    """One backward tensor the policy holds in the low dtype, over all batches.

    Attributes:
        name: Value name in the float32 step graph.
        producer: ``op_type 'node name'`` of its producer.
        elements: Entries seen (all batches).
        nonzero: Nonzero entries seen.
        absmax: Largest magnitude (float32).
        flush: Scale -> share of nonzero entries that round to zero at that scale.
        subnormal: Scale -> share of nonzero entries below the smallest normal at that scale.
        overflow_margin: Scale -> largest finite / (absmax * scale); below 1 overflows.
    """

    name: str
    producer: str
    elements: int
    nonzero: int
    absmax: float
    flush: dict[float, float]
    subnormal: dict[float, float]
    overflow_margin: dict[float, float]


@dataclasses.dataclass(frozen=True)
class ScaleAdvice:
    """The recommendation and the per-tensor evidence.

    Attributes:
        dtype: The low dtype (``float16``).
        batches: Batches measured.
        tensors: Per-tensor statistics, most flushed at scale 1 first.
        flush_at: Scale -> flush share over all tensors (nonzero entries).
        underflow_bound: Smallest candidate scale with flush share <= ``max_flush``
            (``None``: none does).
        overflow_bound: Largest candidate scale with the headroom on every batch (``None``: even
            scale 1 overflows).
        recommended: The initial scale to use (``None``: no candidate works).
        dynamic: Whether dynamic scaling is needed.
        reason: The recommendation in words.
    """

    dtype: str
    batches: int
    tensors: list[TensorScaleStats]
    flush_at: dict[float, float]
    underflow_bound: float | None
    overflow_bound: float | None
    recommended: float | None
    dynamic: bool
    reason: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def low_backward_values(step: ir.Model, policy: Policy) -> dict[str, str]:
    """Names of the float32 step graph's backward values the policy holds low -> producer label.

    Converts a copy with ``policy``: a backward node it lowers holds its outputs low, and a
    ``Cast(to=low)`` inserted at a boundary holds its (backward) input low.
    """
    from mpgraph.convert import convert

    roles = {v.name: n for n in step.graph for v in n.outputs if v.name}

    def backward(name: str) -> bool:
        node = roles.get(name)
        return node is not None and node.metadata_props.get(md.NODE_ROLE) == "backward"

    low = policy.dtype.name.lower()
    converted = convert(as_model(step, copy=True), policy, validate=False, calibrate=None)
    held: dict[str, str] = {}
    for node in converted.graph:
        inserted = node.metadata_props.get(md.NODE_INSERTED)
        if inserted == "cast":
            src = node.inputs[0]
            if src is not None and src.name and node.outputs[0].dtype == policy.dtype and backward(src.name):
                held.setdefault(src.name, f"{roles[src.name].op_type} '{roles[src.name].name}'")
        elif inserted is None and node.metadata_props.get(md.NODE_PRECISION) == low:
            for value in node.outputs:
                if value.name and backward(value.name) and is_float(value.dtype):
                    held.setdefault(value.name, f"{node.op_type} '{node.name}'")
    return held


def advise_scale(
    step: ir.Model,
    batches: Sequence[Mapping[str, np.ndarray]],
    policy: str | os.PathLike | Policy = "fp16",
    *,
    scales: Iterable[float] = CANDIDATE_SCALES,
    max_flush: float = 1e-3,
    headroom: float = 8.0,
    min_window_bits: int = 4,
) -> ScaleAdvice:
    """Recommend an initial loss scale for ``step`` under ``policy`` from float32 batches.

    Args:
        step: A float32 training step graph (``build_training_graph``).
        batches: Data feeds, one mapping per batch.
        policy: The low-precision policy (its loss-scaling section is ignored).
        scales: Candidate scales, ascending.
        max_flush: Largest acceptable share of nonzero backward entries flushed to zero.
        headroom: Required overflow margin at the recommended scale.
        min_window_bits: Below this many powers of two between the bounds, scale dynamically.

    Raises:
        MpgraphError: Not a float32 step graph, no batches, or the policy lowers no backward value.
    """
    props = step.metadata_props
    if not StepContract.is_training(step):
        raise MpgraphError("advise-scale needs a training step graph (run train-graph first)")
    if md.MODEL_POLICY in props:
        raise MpgraphError("advise-scale needs the float32 step graph, not a converted one")
    if not batches:
        raise MpgraphError("advise-scale needs at least one batch")
    for i, feeds in enumerate(batches):
        check_inputs(feeds, f"batch {i + 1}")  # a NaN batch flushes nothing: a scale "works"
    pol = load_policy(policy)
    scales = sorted(float(s) for s in scales)
    held = low_backward_values(step, pol)
    if not held:
        raise MpgraphError(f"policy {pol.name} lowers no backward value of this step graph: no loss scale needed")
    tiny = smallest_subnormal(pol.dtype) / 2
    normal = float(np.finfo(np.float16).tiny) if pol.dtype == ir.DataType.FLOAT16 else _smallest_normal(pol.dtype)
    biggest = finite_max(pol.dtype)
    counts = {name: _Counts(len(scales)) for name in held}
    batch_max: list[float] = []
    for feeds in batches:
        arrays = run_with_values(step, feeds, lambda v: v.name in held)
        peak = 0.0
        for name, array in arrays.items():
            if name in counts:
                peak = max(peak, counts[name].add(np.asarray(array), scales, tiny, normal))
        batch_max.append(peak)
    tensors = [c.stats(name, held[name], scales, biggest) for name, c in counts.items()]
    tensors.sort(key=lambda t: (-t.flush[scales[0]], t.name))
    nonzero = sum(t.nonzero for t in tensors)
    flush_at = {s: (sum(counts[t.name].flushed[i] for t in tensors) / nonzero if nonzero else 0.0)
                for i, s in enumerate(scales)}
    under = next((s for s in scales if flush_at[s] <= max_flush), None)
    safe = [s for s in scales if all(m == 0 or biggest / (m * s) >= headroom for m in batch_max)]
    over = safe[-1] if safe else None
    return _recommend(pol.dtype.name.lower(), len(batches), tensors, flush_at, under, over, max_flush, headroom,
                      min_window_bits)


def _smallest_normal(dtype: ir.DataType) -> float:
    import ml_dtypes

    from mpgraph.dtypes import numpy_dtype

    return float(ml_dtypes.finfo(numpy_dtype(dtype)).smallest_normal)


class _Counts:
    """Running counts of one tensor over batches."""

    def __init__(self, n: int) -> None:
        self.flushed = np.zeros(n, np.int64)
        self.below_normal = np.zeros(n, np.int64)
        self.elements = 0
        self.nonzero = 0
        self.absmax = 0.0

    def add(self, array: np.ndarray, scales: Sequence[float], tiny: float, normal: float) -> float:
        magnitudes = np.abs(array[np.isfinite(array)].astype(np.float64)).ravel()
        self.elements += array.size
        values = np.sort(magnitudes[magnitudes > 0])
        self.nonzero += values.size
        thresholds = np.asarray(scales)
        self.flushed += np.searchsorted(values, tiny / thresholds, side="right")
        self.below_normal += np.searchsorted(values, normal / thresholds, side="left")
        peak = float(values[-1]) if values.size else 0.0
        self.absmax = max(self.absmax, peak)
        return peak

    def stats(self, name: str, producer: str, scales: Sequence[float], biggest: float) -> TensorScaleStats:
        def share(counts: np.ndarray) -> dict[float, float]:
            return {s: (float(c) / self.nonzero if self.nonzero else 0.0) for s, c in zip(scales, counts)}

        return TensorScaleStats(
            name=name,
            producer=producer,
            elements=self.elements,
            nonzero=self.nonzero,
            absmax=self.absmax,
            flush=share(self.flushed),
            subnormal=share(self.below_normal),
            overflow_margin={s: (biggest / (self.absmax * s) if self.absmax else float("inf")) for s in scales},
        )


def _recommend(
    dtype: str, batches: int, tensors: list[TensorScaleStats], flush_at: dict[float, float],
    under: float | None, over: float | None, max_flush: float, headroom: float, min_window_bits: int,
) -> ScaleAdvice:
    first = min(flush_at)

    def advice(recommended: float | None, dynamic: bool, reason: str) -> ScaleAdvice:
        return ScaleAdvice(dtype, batches, tensors, flush_at, under, over, recommended, dynamic, reason)

    if over is None:
        return advice(None, True, f"backward values overflow {dtype} (margin < {headroom:g}) even unscaled: "
                                  "keep the overflowing ops float32 or use bfloat16")
    if under is None:
        return advice(over, True, f"no candidate scale brings the flush share under {max_flush:g} "
                                  f"(at {scale_label(over)}: {flush_at[over]:.1%}); start at {scale_label(over)}, the largest safe "
                                  "scale, and scale dynamically, or use bfloat16")
    if under > over:
        return advice(over, True, f"underflow needs S >= {scale_label(under)} but overflow allows S <= {scale_label(over)} (with "
                                  f"headroom {headroom:g}): no static scale fits; start at {scale_label(over)}, scale dynamically")
    bits = int(round(np.log2(over / under)))
    if under == first and flush_at[first] == 0.0:
        note = "nothing flushes to zero even unscaled"
    else:
        note = (f"{flush_at[first]:.1%} of nonzero backward entries flush to zero unscaled, "
                f"{flush_at[over]:.1%} at {scale_label(over)}")
    if bits < min_window_bits:
        return advice(over, True, f"{note}; the safe window {scale_label(under)}..{scale_label(over)} is only 2**{bits} wide: "
                                  "scale dynamically")
    return advice(over, False, f"{note}; any scale in {scale_label(under)}..{scale_label(over)} works on these batches: a "
                               f"static scale of {scale_label(over)} is enough (dynamic scaling also starts there)")


def scale_label(scale: float) -> str:
    """``2**13`` for 8192.0, else the number.

    Example:
        >>> scale_label(8192.0), scale_label(3.0)
        ('2**13', '3')
    """
    k = int(np.log2(scale)) if scale > 0 else 0
    return f"2**{k}" if float(2**k) == scale else f"{scale:g}"
