"""``mpgraph compare`` on two training step graphs: loss, gradients, update, first backward divergence."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

__all__ = ["compare_train_report", "is_step_graph"]


def is_step_graph(model: Any) -> bool:
    """Whether ``model`` (an onnx-ir model) is a training step graph."""
    from mpgraph._ir.contract import StepContract

    return StepContract.is_training(model)


def compare_train_report(
    ref_model: Any,
    cand_model: Any,
    feeds: dict | None,
    *,
    threshold: float,
    top: int,
    as_json: bool,
    html: Path | None,
) -> None:
    """Print (and optionally write as HTML) ``compare_train`` of two step graphs."""
    from mpgraph.audit.compare_train import compare_train, write_html
    from mpgraph.cli.console import console
    from mpgraph.data import random_feeds
    from mpgraph.errors import MpgraphError

    if not is_step_graph(cand_model):
        raise MpgraphError("the reference is a training step graph but the candidate is not; compare like with like")
    report = compare_train(ref_model, cand_model, feeds if feeds is not None else random_feeds(ref_model, seed=0),
                           threshold=threshold)
    if html is not None:
        write_html(report, html)
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
        return
    console.print(f"loss: float32 {report.loss_reference:.6g}, candidate {report.loss_candidate:.6g} "
                  f"(rel error {report.loss_rel_error:.3g}); loss scale {report.scale:g}"
                  + ("; [bold red]update skipped (non-finite gradients)[/]" if report.found_inf else ""),
                  highlight=False, soft_wrap=True)
    for rows, title in ((report.gradients, "gradients (unscaled)"), (report.updates, "one-step updates")):
        table = Table(title=title)
        for col in ("parameter", "rel error", "underflow share", "non-finite"):
            table.add_column(col, justify="left" if col == "parameter" else "right")
        for r in sorted(rows, key=lambda r: (r.nonfinite, r.rel_error), reverse=True)[:top]:
            table.add_row(r.name, f"{r.rel_error:.3g}", f"{r.underflow:.3g}", str(r.nonfinite))
        console.print(table)
    if report.fp8:
        table = Table(title="fp8 tensors (this step)")
        for col in ("tensor", "format", "scale", "entries", "saturated", "flushed to zero"):
            table.add_column(col, justify="left" if col in ("tensor", "format") else "right")
        for t in report.fp8:
            table.add_row(t.tensor, t.format, f"{t.scale:g}", str(t.entries), f"{t.saturated:.3g}", f"{t.flushed:.3g}")
        console.print(table)
    for label, v in (("first divergence", report.first_divergence), ("first backward divergence", report.first_backward_divergence)):
        if v is None:
            console.print(f"{label}: none past {threshold:g} ({len(report.values)} values compared)", highlight=False)
        else:
            console.print(f"[bold]{label}[/] (rel error > {threshold:g}, topological order): value '{escape(v.name)}' from "
                          f"{escape(v.producer)} {escape(f'[{v.precision}, {v.role}]')}: rel error {v.rel_error:.3g}, "
                          f"underflow share {v.underflow:.3g}, non-finite {v.nonfinite}", highlight=False, soft_wrap=True)
    if html is not None:
        console.print(f"wrote {html}", highlight=False)
