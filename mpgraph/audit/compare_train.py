"""``compare`` for training step graphs: loss, every gradient, the step's update, value by value.

Both step graphs (the float32 one and its conversion) run one step in ONNX Runtime (CPU) on the
same batch from the same state, with every float value exposed. Under loss scaling the
candidate's backward values are the scale times the true ones: every value downstream of the
gradient seed (through backward nodes) is divided by the candidate's scale before it is
compared, so the numbers read as the gradients the optimizer sees.

The report holds:

1. the **loss** of both;
2. every **gradient** the optimizer reads: relative error, the share of entries that are
   nonzero in float32 but zero in the candidate (underflow), and non-finite entries;
3. every parameter's **one-step update** (``<param>/updated - <param>``): relative error
   (a skipped step, ``found_inf``, shows as an update of zero: error 1);
4. every value along the graph in the candidate's topological order, and the **first backward
   value** whose relative error passes the threshold: the node where the backward pass
   starts to diverge;
5. for an fp8 candidate, per quantised tensor the scale used and the shares of entries that
   saturate or flush to zero.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph.audit.compare import match_value, relative_error, run_all
from mpgraph.audit.fp8_stats import Fp8TensorStats, fp8_stats
from mpgraph.data import check_inputs
from mpgraph.errors import MpgraphError

__all__ = ["TensorDivergence", "StepValueDivergence", "TrainCompareReport", "compare_train", "render_html"]


@dataclasses.dataclass(frozen=True)
class TensorDivergence:
    """One gradient (or update) of the candidate against the reference.

    Attributes:
        name: Parameter name.
        value: The compared value's name in the reference.
        rel_error: ``||cand - ref|| / ||ref||`` (``inf`` with non-finite entries).
        underflow: Share of the reference's nonzero entries that are zero in the candidate.
        nonfinite: Entries that are inf/NaN in the candidate and finite in the reference.
    """

    name: str
    value: str
    rel_error: float
    underflow: float
    nonfinite: int


@dataclasses.dataclass(frozen=True)
class StepValueDivergence:
    """One value along the graph (topological order of the candidate).

    Attributes:
        name: Value name.
        producer: ``op_type 'node name'``.
        role: The producer's role (forward, loss, backward, optimizer).
        precision: The producer's recorded precision in the candidate.
        rel_error: Relative error against the reference (unscaled).
        underflow: Share of the reference's nonzero entries that are zero in the candidate.
        nonfinite: Entries non-finite in the candidate only.
    """

    name: str
    producer: str
    role: str
    precision: str
    rel_error: float
    underflow: float
    nonfinite: int


@dataclasses.dataclass(frozen=True)
class TrainCompareReport:
    """One step of two step graphs, compared.

    Attributes:
        loss_reference: The float32 loss.
        loss_candidate: The candidate's loss.
        loss_rel_error: ``|cand - ref| / |ref|``.
        scale: The candidate's loss scale (1 without loss scaling).
        found_inf: Whether the candidate skipped the update (non-finite gradients).
        gradients: Per parameter gradient errors.
        updates: Per parameter one-step update errors.
        values: Every matched value, topological order.
        threshold: Relative error at which a value counts as diverged.
        first_divergence: First value past the threshold (any role).
        first_backward_divergence: First backward value past the threshold.
        fp8: Per quantised tensor of an fp8 candidate: the scale used, the shares of its
            entries that saturate and flush to zero (``mpgraph.audit.fp8_stats``).
    """

    loss_reference: float
    loss_candidate: float
    loss_rel_error: float
    scale: float
    found_inf: bool
    gradients: list[TensorDivergence]
    updates: list[TensorDivergence]
    values: list[StepValueDivergence]
    threshold: float
    first_divergence: StepValueDivergence | None
    first_backward_divergence: StepValueDivergence | None
    fp8: list[Fp8TensorStats] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        def clean(x: object) -> object:
            if isinstance(x, float) and not math.isfinite(x):
                return str(x)
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        return json.dumps(clean(dataclasses.asdict(self)), indent=2)


def _errors(ref: np.ndarray, cand: np.ndarray) -> tuple[float, float, int] | None:
    """(relative error, underflow share, non-finite count), or None when not comparable."""
    if ref.shape != cand.shape or ref.dtype.kind != "f" or cand.dtype.kind != "f":
        return None
    r = ref.astype(np.float64)
    c = cand.astype(np.float64)
    finite = np.isfinite(r)
    nonfinite = int((finite & ~np.isfinite(c)).sum())
    nonzero = finite & (r != 0)
    underflow = float((nonzero & (c == 0)).sum() / nonzero.sum()) if nonzero.any() else 0.0
    return relative_error(r, c), underflow, nonfinite


def _run(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run_all(model, feeds, with_bool=True, what="step graph")


def _scaled_values(model: ir.Model) -> set[str]:
    """Values downstream of the gradient seed through backward nodes (scaled by the loss scale)."""
    seed = StepContract.read(model).grad_seed
    start = [v for n in model.graph for v in n.outputs if v.name == "loss_scale/scaled_seed"]
    start += [v for n in model.graph for v in n.outputs if v.name == seed and not start]
    scaled: set[str] = set()
    stack = list(start)
    while stack:
        value = stack.pop()
        if value.name in scaled:
            continue
        scaled.add(value.name or "")
        for use in value.uses():
            node = use.node
            if node.metadata_props.get(md.NODE_ROLE, "backward") != "backward" and not node.metadata_props.get(md.NODE_INSERTED):
                continue
            stack.extend(node.outputs)
    return scaled


def _state_value(model: ir.Model, name: str) -> np.ndarray | None:
    value = model.graph.initializers.get(name)
    return None if value is None or value.const_value is None else value.const_value.numpy()


def compare_train(
    reference: ir.Model,
    candidate: ir.Model,
    feeds: Mapping[str, np.ndarray],
    *,
    threshold: float = 1e-2,
) -> TrainCompareReport:
    """Compare one training step of ``candidate`` (a conversion) with ``reference`` (float32).

    Args:
        reference: The float32 step graph.
        candidate: Its conversion (emulated for bfloat16 on CPU).
        feeds: One batch of data inputs (state comes from the graphs' initializers).
        threshold: Relative error at which a value counts as diverged.

    Raises:
        MpgraphError: Not step graphs, or ORT cannot run one of them.
    """
    for label, model in (("reference", reference), ("candidate", candidate)):
        if not StepContract.is_training(model) or not StepContract.recorded(model):
            raise MpgraphError(f"{label} is not a training step graph (run train-graph first)")
    # The loss-scale state, by role (the step contract); none: not loss-scaled.
    state = StepContract.read(candidate).loss_scale
    scale_value = _state_value(candidate, state.scale) if state is not None and state.scale is not None else None
    scale = float(scale_value) if scale_value is not None else 1.0
    check_inputs(feeds, "inputs")
    ref = _run(reference, feeds)
    cand = _run(candidate, feeds)
    scaled = _scaled_values(candidate)

    def cand_value(name: str) -> np.ndarray:
        array = cand[name]
        base = name[len("round/"):] if name.startswith("round/") else name
        return array / scale if (base in scaled or name in scaled) and scale != 1.0 else array

    loss_ref, loss_cand, loss_err = _loss(reference, candidate, ref, cand)
    found_inf = state is not None and bool(np.asarray(cand.get(state.found_inf, False)).any())
    params = [list(pair) for pair in StepContract.read(reference).gradients or ()]
    values = _along_graph(candidate, ref, cand, cand_value)
    first = next((v for v in values if v.rel_error > threshold), None)
    first_back = next((v for v in values if v.role == "backward" and v.rel_error > threshold), None)
    return TrainCompareReport(loss_ref, loss_cand, loss_err, scale, found_inf, _gradients(params, ref, cand, cand_value),
                              _updates(reference, params, ref, cand), values, threshold, first, first_back,
                              fp8_stats(candidate, cand))


def _loss(reference: ir.Model, candidate: ir.Model, ref: Mapping[str, np.ndarray],
          cand: Mapping[str, np.ndarray]) -> tuple[float, float, float]:
    """(reference loss, candidate loss, relative error; inf when the candidate's is not finite)."""
    loss_ref = float(ref[StepContract.read(reference).loss or "loss"])
    loss_cand = float(cand[StepContract.read(candidate).loss or "loss"])
    loss_err = abs(loss_cand - loss_ref) / abs(loss_ref) if loss_ref else float(loss_cand != loss_ref)
    if not math.isfinite(loss_cand):
        loss_err = float("inf")
    return loss_ref, loss_cand, loss_err


def _gradients(params: Sequence[tuple[str, str]], ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray],
               cand_value: Callable[[str], np.ndarray]) -> list[TensorDivergence]:
    """Each parameter's gradient as the optimizer reads it: the candidate's unscaled one when it has one."""
    gradients = []
    for param, grad in params:
        unscaled = f"loss_scale/{param}/unscaled"
        if unscaled in cand:
            got = cand[unscaled]
        else:
            match = match_value(grad, ref, cand)
            if match is None:
                continue
            got = cand_value(match[1])
        errs = _errors(ref[grad], got) if grad in ref else None
        if errs is not None:
            gradients.append(TensorDivergence(param, grad, *errs))
    return gradients


def _updates(reference: ir.Model, params: Sequence[tuple[str, str]], ref: Mapping[str, np.ndarray],
             cand: Mapping[str, np.ndarray]) -> list[TensorDivergence]:
    """Each parameter's one-step update, ``<param>/updated - <param>``, from the reference's start."""
    updates = []
    for param, _ in params:
        start = _state_value(reference, param)
        out = f"{param}/updated"
        if start is None or out not in ref or out not in cand:
            continue
        errs = _errors(ref[out] - start, cand[out] - start)
        if errs is not None:
            updates.append(TensorDivergence(param, out, *errs))
    return updates


def _along_graph(candidate: ir.Model, ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray],
                 cand_value: Callable[[str], np.ndarray]) -> list[StepValueDivergence]:
    """Every matched value of the candidate's own nodes, in its topological order."""
    values = []
    for node in candidate.graph:
        if node.metadata_props.get(md.NODE_INSERTED):
            continue
        label = f"{node.op_type} '{node.name}'"
        role = node.metadata_props.get(md.NODE_ROLE, "forward")
        precision = node.metadata_props.get(md.NODE_PRECISION, "?")
        for value in node.outputs:
            match = match_value(value.name or "", ref, cand)
            if match is None:
                continue
            errs = _errors(ref[match[0]], cand_value(match[1]))
            if errs is not None:
                values.append(StepValueDivergence(match[0], label, role, precision, *errs))
    return values


_ROLE_COLORS = {"forward": "#1f77b4", "loss": "#9467bd", "backward": "#ff7f0e", "optimizer": "#2ca02c"}


def render_html(report: TrainCompareReport, *, title: str = "mpgraph compare (training step)") -> str:
    """A self-contained page: the summary, the relative error of every value along the graph
    (topological order, log scale, colored by role) as inline SVG, and the gradient and update tables."""
    esc = html.escape
    legend = " ".join(f'<span style="color:{c}">&#9679; {r}</span>' for r, c in _ROLE_COLORS.items())

    def table(rows: Sequence[TensorDivergence], head: str) -> str:
        body = "".join(f"<tr><td>{esc(r.name)}</td><td>{r.rel_error:.3g}</td><td>{r.underflow:.3g}</td>"
                       f"<td>{r.nonfinite}</td></tr>" for r in rows)
        return (f"<h2>{esc(head)}</h2><table><tr><th>parameter</th><th>rel error</th><th>underflow share</th>"
                f"<th>non-finite</th></tr>{body}</table>")

    def first(v: StepValueDivergence | None) -> str:
        if v is None:
            return f"none past {report.threshold:g}"
        return f"{esc(v.name)} from {esc(v.producer)} [{esc(v.precision)}]: rel error {v.rel_error:.3g}"

    summary = (f"<p>loss: float32 {report.loss_reference:.6g}, candidate {report.loss_candidate:.6g} "
               f"(rel error {report.loss_rel_error:.3g}); loss scale {report.scale:g}; update skipped: "
               f"{'yes' if report.found_inf else 'no'}</p>"
               f"<p>first divergence: {first(report.first_divergence)}<br>"
               f"first backward divergence: {first(report.first_backward_divergence)}</p>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}td+td{text-align:right}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{esc(title)}</title><style>{style}</style>"
            f"</head><body><h1>{esc(title)}</h1>{summary}<h2>relative error of every value</h2><p>{legend}; red: "
            f"non-finite; dashed: threshold {report.threshold:g}; vertical: first backward divergence</p>{_svg(report)}"
            f"{table(report.gradients, 'gradients')}{table(report.updates, 'one-step updates')}</body></html>")


def _svg(report: TrainCompareReport) -> str:
    """The relative error of every value along the graph: log scale, colored by role, with the
    threshold (dashed) and the first backward divergence (vertical)."""
    points = report.values
    width, height, pad = 1000, 320, 48
    lo, hi = -8.0, 1.0

    def y_of(err: float) -> float:
        e = hi if not math.isfinite(err) else min(max(math.log10(err) if err > 0 else lo, lo), hi)
        return pad + (hi - e) / (hi - lo) * (height - 2 * pad)

    def x_of(i: int) -> float:
        return pad + i / max(len(points) - 1, 1) * (width - 2 * pad)

    marks = []
    for i, v in enumerate(points):
        color = "#d62728" if v.nonfinite else _ROLE_COLORS.get(v.role, "#7f7f7f")
        tip = f"{i}: {v.name} ({v.producer}, {v.role}, {v.precision}) rel error {v.rel_error:.3g}, " \
              f"underflow {v.underflow:.3g}, non-finite {v.nonfinite}"
        marks.append(f'<circle cx="{x_of(i):.1f}" cy="{y_of(v.rel_error):.1f}" r="2.5" fill="{color}">'
                     f"<title>{html.escape(tip)}</title></circle>")
    grid = []
    for e in range(int(lo), int(hi) + 1):
        y = y_of(10.0**e)
        grid.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                    f'<text x="{pad - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end">1e{e}</text>')
    ty = y_of(report.threshold)
    grid.append(f'<line x1="{pad}" x2="{width - pad}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="#d62728" stroke-dasharray="4 3"/>')
    if report.first_backward_divergence is not None:
        i = points.index(report.first_backward_divergence)
        grid.append(f'<line x1="{x_of(i):.1f}" x2="{x_of(i):.1f}" y1="{pad}" y2="{height - pad}" stroke="#d62728"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
            f'aria-label="relative error along the graph">{"".join(grid)}{"".join(marks)}'
            f'<text x="{width / 2}" y="{height - 8}" font-size="11" text-anchor="middle">values in topological order '
            f"(forward, loss, backward, optimizer)</text></svg>")


def write_html(report: TrainCompareReport, path: str | os.PathLike) -> None:
    """Write ``render_html`` atomically."""
    from mpgraph.io import write_atomic

    write_atomic(path, render_html(report).encode())
