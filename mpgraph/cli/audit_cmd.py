"""``mpgraph audit``: which ops run in which precision and why, casts and weight bytes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from mpgraph.cli.console import console, human_bytes

if TYPE_CHECKING:
    from mpgraph.audit import AuditReport

__all__ = ["audit_command"]


def audit_command(
    model: Annotated[Path, typer.Argument(help="A model written by `mpgraph convert`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    nodes: Annotated[bool, typer.Option("--nodes", help="Also list every node with its precision and reason.")] = False,
    memory: Annotated[bool, typer.Option("--memory", help="Estimate a training step's memory: bytes per parameter by role, activations by liveness.")] = False,
    batch: Annotated[int | None, typer.Option("--batch", help="With --memory: the batch size symbolic dims take (default 1).")] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help="With --memory on a forward model: build its step graph with this optimizer (default adamw).")] = None,
    mem_policy: Annotated[str | None, typer.Option("--policy", help="With --memory on a float32 model: convert with this policy first.")] = None,
    pipelined: Annotated[bool, typer.Option("--pipelined", help="With --memory: for a pipelined CUDA trainer, which holds a third state set (mpgraph train's default on CUDA for states up to 512 MiB).")] = False,
    inplace: Annotated[bool, typer.Option("--inplace", help="With --memory: the state updated in place (the CUDA default for a state over 512 MiB; mpgraph train --inplace-state): one buffer per state value where provably safe.")] = False,
    nproc: Annotated[int | None, typer.Option("--nproc", help="With --memory: also the bytes per rank of a data-parallel run on this many processes.")] = None,
    shard_optimizer: Annotated[bool, typer.Option("--shard-optimizer", help="With --memory --nproc: the optimizer state sharded over the ranks (ZeRO-1).")] = False,
) -> None:
    """Show which ops run in which precision, the casts inserted, and weight bytes."""
    from mpgraph.audit import audit
    from mpgraph.errors import UsageError
    from mpgraph.io import load_model

    if memory:
        from mpgraph.cli.memory_cmd import memory_report

        return memory_report(model, batch=1 if batch is None else batch, optimizer=optimizer, policy=mem_policy,
                             as_json=as_json, pipelined=pipelined, nproc=nproc, shard_optimizer=shard_optimizer,
                             inplace=inplace)
    # These shape the memory estimate only: silently ignored, they read as if they had applied.
    given = [flag for flag, value in (("--batch", batch), ("--optimizer", optimizer), ("--policy", mem_policy),
                                      ("--pipelined", pipelined or None), ("--inplace", inplace or None), ("--nproc", nproc),
                                      ("--shard-optimizer", shard_optimizer or None)) if value is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: only with --memory (the memory estimate); add --memory, or leave "
                         f"{'it' if len(given) == 1 else 'them'} out")
    report = audit(load_model(model))
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
        return
    if report.policy is None:
        console.print(f"[yellow]{model} was not converted by mpgraph (no decisions recorded)[/]")
    console.print(
        f"[bold]{model}[/]  policy={report.policy}  dtype={report.dtype}"
        + ("  [cyan](CPU emulation)[/]" if report.emulated else "")
    )
    _print_op_tables(report)
    console.print(
        f"casts inserted: {report.casts_inserted}   emulation roundings: {report.rounds_inserted}   "
        f"Cast nodes in graph: {report.casts_total}"
    )
    console.print(
        f"float weights: {human_bytes(report.weight_bytes_before)} before -> {human_bytes(report.weight_bytes_after)} after"
    )
    if report.loss_scaling is not None:
        scaling = report.loss_scaling
        console.print("loss scaling: " + ", ".join(f"{k}={scaling[k]}" for k in sorted(scaling)), highlight=False)
    if report.fp8 is not None:
        _print_fp8(report.fp8)
    for event in report.initializer_range:
        console.print(
            f"[yellow]range:[/] {event['name']}: {event['overflow']} overflow, {event['underflow']} underflow -> {event['action']}"
        )
    _print_reasons(report, nodes=nodes)


def _print_op_tables(report: AuditReport) -> None:
    """One table per role: op types by precision, with totals."""
    for role, ops in report.ops.items():
        precisions = sorted({p for counts in ops.values() for p in counts})
        table = Table(title=None if role == "all" else f"role: {role}", show_footer=True)
        table.add_column("op type", footer="total")
        for p in precisions:
            table.add_column(p, justify="right", footer=str(sum(c.get(p, 0) for c in ops.values())))
        for op_type, counts in ops.items():
            table.add_row(op_type, *(str(counts.get(p, "")) for p in precisions))
        console.print(table)


def _print_reasons(report: AuditReport, *, nodes: bool) -> None:
    """The 15 most common reasons, then (``--nodes``) every node's decision."""
    reasons = Table(title="why (nodes per reason)")
    reasons.add_column("nodes", justify="right")
    reasons.add_column("reason")
    for reason, count in list(report.reasons.items())[:15]:
        reasons.add_row(str(count), reason)
    console.print(reasons)
    if nodes:
        detail = Table(title="nodes")
        for col in ("name", "op_type", "role", "precision", "reason"):
            detail.add_column(col)
        for rec in report.nodes:
            detail.add_row(*(rec[c] for c in ("name", "op_type", "role", "precision", "reason")))
        console.print(detail)


def _print_fp8(fp8: dict) -> None:
    """The fp8 recipe and one row per quantised tensor."""
    recipe, tensors = fp8["recipe"], fp8["tensors"]
    formats = sorted({t["format"] for t in tensors.values()})
    counts = ", ".join(f"{sum(t['format'] == f for t in tensors.values())} {f}" for f in formats)
    settings = (f"history {recipe['history']}, amax {recipe['amax']}, " if recipe["used"] == "delayed" else "")
    console.print(f"fp8: {len(tensors)} tensors ({counts}), {fp8['nodes']} quantisation nodes; scaling {recipe['used']} "
                  f"({settings}margin {recipe['margin']}, rounding {recipe['rounding']})", highlight=False)
    table = Table(title="fp8 tensors")
    for col in ("tensor", "format", "kind", "scale", "products"):
        table.add_column(col)
    for name, t in tensors.items():
        scale = f"{t['scale']} = {t['scale_value']:g}" if t["scale"] else "amax of each run"
        table.add_row(name, t["format"], t["kind"], scale, ", ".join(t["gemms"]))
    console.print(table)
