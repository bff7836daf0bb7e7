"""``mpgraph compare``: run two models on the same inputs and show where the numbers diverge."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mpgraph.cli.console import console
from mpgraph.cli.paths import output_path

if TYPE_CHECKING:
    from mpgraph.audit import CompareReport

__all__ = ["compare_command"]


def compare_command(
    reference: Annotated[Path, typer.Argument(help="The float32 model.")],
    candidate: Annotated[Path, typer.Argument(help="The converted model (--emulate for bf16 on CPU).")],
    inputs: Annotated[Path | None, typer.Option("--inputs", help=".npz of inputs keyed by input name; default: seeded random.")] = None,
    threshold: Annotated[float, typer.Option("--threshold", help="Relative error at which a value counts as diverged.")] = 1e-2,
    top: Annotated[int, typer.Option("--top", help="How many of the worst values to list.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    html: Annotated[Path | None, typer.Option("--html", parser=output_path, metavar="PATH", help="Training step graphs: also write a self-contained HTML page of the error along the graph.")] = None,
) -> None:
    """Run both models on the same inputs and show where the numbers diverge, value by value.

    On two training step graphs: one step each, comparing the loss, every gradient, the update
    and every value, and naming the first backward node that diverges."""
    from mpgraph.audit import compare
    from mpgraph.cli.checks import check_output_path, finite, read_inputs_npz
    from mpgraph.cli.compare_train_cmd import compare_train_report, is_step_graph
    from mpgraph.errors import UsageError
    from mpgraph.io import load_model

    finite(threshold, "--threshold", low=0.0, low_open=True)
    if top < 0:
        raise UsageError(f"--top must be >= 0, got {top}")
    ref_model = load_model(reference)
    cand_model = load_model(candidate)
    feeds = read_inputs_npz(inputs, ref_model, "--inputs") if inputs is not None else None
    check_output_path(html, "--html")
    if is_step_graph(ref_model):
        return compare_train_report(ref_model, cand_model, feeds, threshold=threshold, top=top, as_json=as_json, html=html)
    if html is not None:
        raise UsageError("--html needs two training step graphs")
    report = compare(ref_model, cand_model, feeds, threshold=threshold)
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
        return
    _print_report(report, threshold=threshold, top=top)


def _print_report(report: CompareReport, *, threshold: float, top: int) -> None:
    """The graph outputs, the first divergence in topological order, the worst values, notes."""
    table = Table(title="graph outputs")
    for col in ("output", "rel error", "max |diff|", "non-finite"):
        table.add_column(col)
    for v in report.outputs:
        table.add_row(v.name, f"{v.rel_error:.3g}", f"{v.max_abs_error:.3g}", str(v.nonfinite))
    console.print(table)
    if report.first_divergence is None:
        console.print(f"no value diverges beyond {threshold:g} ({len(report.values)} values compared)")
    else:
        v = report.first_divergence
        console.print(
            f"[bold]first divergence[/] (rel error > {threshold:g}, topological order): value '{escape(v.name)}' "
            f"from {escape(v.producer)} {escape(f'[{v.precision}]')}: {v.kind}, rel error {v.rel_error:.3g}, "
            f"non-finite {v.nonfinite}, flushed to zero {v.flushed}",
            highlight=False, soft_wrap=True,
        )
    worst = Table(title=f"worst {top} of {len(report.values)} values")
    for col in ("value", "producer", "precision", "kind", "rel error", "non-finite", "flushed"):
        worst.add_column(col)
    for v in report.worst(top):
        worst.add_row(v.name, v.producer, v.precision, v.kind, f"{v.rel_error:.3g}", str(v.nonfinite), str(v.flushed))
    console.print(worst)
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
