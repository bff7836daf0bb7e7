"""``mpgraph advise-scale``: recommend an initial loss scale from a few float32 batches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mpgraph.cli.console import console

__all__ = ["advise_scale_command", "split_batches"]


def split_batches(arrays: dict, parts: int) -> list[dict]:
    """Split every array along axis 0 into ``parts`` batches (each needs at least ``parts`` rows)."""
    from mpgraph.errors import DataError

    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] < parts:
            raise DataError(f"--batches {parts}: input '{name}' has {array.shape[0] if array.ndim else 0} rows, "
                            f"fewer than {parts}")
    import numpy as np

    split = {k: np.array_split(v, parts, axis=0) for k, v in arrays.items()}
    return [{k: chunks[i] for k, chunks in split.items()} for i in range(parts)]


def advise_scale_command(
    step: Annotated[Path, typer.Argument(help="The float32 training step graph (from train-graph).")],
    data: Annotated[list[Path] | None, typer.Option("--data", help=".npz of one batch keyed by input name (repeatable); default: one seeded random batch.")] = None,
    batches: Annotated[int, typer.Option("--batches", help="Split each --data file along its first axis into this many batches.")] = 1,
    policy: Annotated[str, typer.Option("--policy", "-p", help="The low-precision policy (its loss-scaling section is ignored).")] = "fp16",
    max_flush: Annotated[float, typer.Option("--max-flush", help="Acceptable share of nonzero backward entries flushed to zero.")] = 1e-3,
    headroom: Annotated[float, typer.Option("--headroom", help="Required overflow margin at the recommended scale.")] = 8.0,
    top: Annotated[int, typer.Option("--top", help="How many tensors to list (most flushed first).")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the advice as JSON.")] = False,
) -> None:
    """Measure backward values on float32 batches; recommend an initial loss scale and say if it must be dynamic."""
    from mpgraph.advise import advise_scale, scale_label
    from mpgraph.cli.checks import finite
    from mpgraph.data import check_inputs, random_feeds, read_npz
    from mpgraph.errors import UsageError
    from mpgraph.io import load_model

    finite(max_flush, "--max-flush", low=0.0, high=1.0)
    finite(headroom, "--headroom", low=1.0)
    if batches < 1 or top < 0:
        raise UsageError(f"--batches must be >= 1 and --top >= 0, got {batches} and {top}")
    model = load_model(step)
    feeds: list[dict] = []
    for path in data or []:
        arrays = read_npz(path)
        check_inputs(arrays, f"--data {path}")
        feeds += split_batches(arrays, batches)
    if not feeds:
        feeds = [random_feeds(model, seed=i) for i in range(batches)]
    advice = advise_scale(model, feeds, policy, max_flush=max_flush, headroom=headroom)
    if as_json:
        sys.stdout.write(advice.to_json() + "\n")
        return
    scales = sorted(advice.flush_at)
    shown = sorted({s for s in scales if int(s).bit_length() % 4 == 1} | {s for s in (advice.underflow_bound, advice.overflow_bound) if s})
    table = Table(title=f"{advice.dtype} backward values over {advice.batches} batch(es), by loss scale")
    for col in ("scale", "share flushed to zero", "worst tensor's share", "smallest overflow margin"):
        table.add_column(col, justify="right")
    for s in shown:
        worst = max(t.flush[s] for t in advice.tensors)
        margin = min(t.overflow_margin[s] for t in advice.tensors)
        table.add_row(scale_label(s), f"{advice.flush_at[s]:.3g}", f"{worst:.3g}", f"{margin:.3g}")
    console.print(table)
    at = advice.recommended or 1.0
    label = scale_label(at)
    detail = Table(title=f"tensors, most flushed unscaled first (scale 1 vs {label})")
    for col in ("value", "producer", "nonzero", "max |g|", "flushed @1", f"flushed @{label}", f"margin @{label}"):
        detail.add_column(col)
    for t in advice.tensors[:top]:
        detail.add_row(t.name, t.producer, str(t.nonzero), f"{t.absmax:.3g}", f"{t.flush[1.0]:.3g}",
                       f"{t.flush[at]:.3g}", f"{t.overflow_margin[at]:.3g}")
    console.print(detail)
    if advice.recommended is None:
        console.print(f"[bold red]no loss scale works[/]: {advice.reason}", highlight=False, soft_wrap=True)
    else:
        mode = "dynamic" if advice.dynamic else "static"
        init = f"{advice.recommended:.0f}"
        console.print(f"[bold]recommended initial scale: {init} ({label})[/], {mode} scaling: {advice.reason}",
                      highlight=False, soft_wrap=True)
        console.print(f"policy: loss_scaling: {{mode: {mode}, init: {init}}}", highlight=False)
