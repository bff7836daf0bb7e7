"""``mpgraph check-grad``: compare a model's training gradients with finite differences.

Exit codes: 0 when every parameter agrees, 1 when some parameter disagrees (the report names
the node whose gradient rule is wrong), 2 on bad input (one ``error:`` line).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mpgraph.cli.console import console, err_console

__all__ = ["check_grad_command"]


def check_grad_command(
    model: Annotated[Path, typer.Argument(help="Forward .onnx model (as given to train-graph).")],
    loss: Annotated[str | None, typer.Option("--loss", help="cross_entropy, mse, or the name of a loss output (default: as train-graph).")] = None,
    inputs: Annotated[Path | None, typer.Option("--inputs", help=".npz of the model's data inputs keyed by input name; default: seeded, valid values.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of generated inputs and directions.")] = 0,
    batch: Annotated[int, typer.Option("--batch", help="Size of symbolic leading dims of generated inputs.")] = 2,
    freeze: Annotated[list[str] | None, typer.Option("--freeze", help="fnmatch pattern of parameters to leave out (repeatable).")] = None,
    batchnorm: Annotated[str, typer.Option("--batchnorm", help="train, train-ops or eval (as train-graph).")] = "train",
    float32: Annotated[bool, typer.Option("--float32", help="Finite differences in float32 even where float64 kernels exist.")] = False,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="Check at seeded random parameters (for files whose weights are placeholders).")] = False,
    localize: Annotated[bool, typer.Option("--localize/--no-localize", help="On failure, check each node on the backward path alone.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check every parameter's gradient against central finite differences (no torch needed)."""
    from mpgraph.check_grad import check_grad
    from mpgraph.errors import MpgraphError

    if batch < 1:
        raise MpgraphError(f"--batch must be >= 1, got {batch}")
    columns = (TextColumn("[bold]{task.description}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, disable=as_json, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)

        report = check_grad(model, loss=loss, inputs=inputs, seed=seed, batch=batch, freeze=freeze or (),
                            batchnorm=batchnorm, float64=not float32, localize=localize,
                            random_weights=random_weights, progress=progress)
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        console.print(f"[bold]{model}[/]: loss '{report.loss}', finite differences in {report.dtype}, "
                      f"gradient graph in {report.analytic_dtype}, relative step {report.step:g}, "
                      f"tolerance {report.rtol:g}", highlight=False, soft_wrap=True)
        if report.dtype_note:
            console.print(f"  ({report.dtype_note})", highlight=False, soft_wrap=True)
        table = Table()
        for col, justify in (("parameter", "left"), ("size", "right"), ("analytic", "right"), ("numeric", "right"),
                             ("rel error", "right"), ("±", "right"), ("", "left")):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        style = {"pass": "[green]ok[/]", "noisy": "[yellow]noisy[/]", "fail": "[bold red]FAIL[/]"}
        for p in report.params:
            table.add_row(p.name, str(p.size), f"{p.analytic:.6g}", f"{p.numeric:.6g}", f"{p.rel_error:.1e}",
                          f"{p.uncertainty:.0e}" if p.status != "pass" else "", style[p.status])
        console.print(table)
        for note in report.notes:
            console.print(f"note: {note}", highlight=False, soft_wrap=True)
        failed = report.failed
        summary = f"{len(report.params) - len(failed)}/{len(report.params)} parameters agree"
        noisy = sum(p.status == "noisy" for p in report.params)
        if noisy:
            summary += f" ({noisy} within the finite differences' own uncertainty)"
        console.print(summary, highlight=False)
        node = report.first_bad_node
        if node is not None:
            console.print(
                f"[bold red]first wrong gradient rule[/] (closest to the loss, of {len(report.bad_nodes)} disagreeing "
                f"among {report.nodes_checked} nodes checked alone): node '{node.name}' ({node.op_type}, rule "
                f"{node.rule}): cotangent of input '{node.input}' {node.analytic:.6g} vs finite difference "
                f"{node.numeric:.6g} (rel error {node.rel_error:.1e}, {node.dtype})", highlight=False, soft_wrap=True)
        elif failed and localize:
            console.print(f"no single node's rule disagrees on its own ({report.nodes_checked} checked)", highlight=False)
    if not report.passed:
        raise typer.Exit(1)
