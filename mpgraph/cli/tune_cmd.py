"""``mpgraph tune``: find the fewest ops to keep float32 so an objective holds; write a policy."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mpgraph.cli.console import console, err_console
from mpgraph.cli.paths import output_path

__all__ = ["tune_command"]


def tune_command(
    model: Annotated[Path, typer.Argument(help="The float32 model (inference graph or training step graph).")],
    policy: Annotated[str, typer.Option("--policy", "-p", help="Base policy: a preset (fp16, bf16, ...) or a YAML file.")] = "fp16",
    objective: Annotated[str, typer.Option("--objective", help="output[:TOL] (every output within TOL relative error, default 2e-3), grad[:TOL] (step graphs: every gradient after one step) or loss[:STEPS[:TOL]] (step graphs: loss after STEPS steps).")] = "output:2e-3",
    inputs: Annotated[Path | None, typer.Option("--inputs", help=".npz of inputs keyed by input name; default: seeded random.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    output: Annotated[Path | None, typer.Option("--output", "-o", parser=output_path, metavar="PATH", help="Policy YAML to write; default MODEL.<policy>.tuned.yaml.")] = None,
    max_evals: Annotated[int, typer.Option("--max-evals", help="Stop after this many conversions.")] = 500,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Find the fewest ops to keep float32 under POLICY so the objective holds; write a policy YAML."""
    import dataclasses
    import json

    from mpgraph.cli.checks import check_output_path
    from mpgraph.data import check_inputs, read_npz
    from mpgraph.errors import UsageError
    from mpgraph.io import write_atomic
    from mpgraph.policy import load_policy
    from mpgraph.tune import parse_objective, tune

    if max_evals < 3:
        raise UsageError(f"--max-evals must be >= 3, got {max_evals}")
    goal = parse_objective(objective)
    pol = load_policy(policy)
    out = output or model.with_name(f"{model.stem}.{pol.name}.tuned.yaml")
    check_output_path(out, "-o")  # before the search, not after it
    feeds = read_npz(inputs) if inputs is not None else None
    if feeds is not None:
        check_inputs(feeds, f"--inputs {inputs}")
    with err_console.status("tuning", spinner="dots") if not as_json else contextlib.nullcontext() as status:
        def progress(n: int, err: float, kept: int) -> None:
            if status is not None:
                status.update(f"tuning: {n} conversions, last error {err:.3g} with {kept} ops float32")

        result = tune(model, pol, objective=goal, feeds=feeds, seed=seed, max_evaluations=max_evals, progress=progress)
    write_atomic(out, result.policy_yaml().encode())
    if as_json:
        sys.stdout.write(json.dumps({**dataclasses.asdict(result), "output": str(out)}, indent=2) + "\n")
        return
    console.print(
        f"[bold]{model}[/] under {result.policy}: {result.objective}; error {result.error_before:.3g} with no "
        f"override -> {result.error_after:.3g} with {len(result.kept)} of {result.candidates} lowered ops kept "
        f"float32 ({result.evaluations} conversions, {result.seconds:.1f} s)", highlight=False, soft_wrap=True)
    if result.kept:
        table = Table(title="kept float32")
        table.add_column("node")
        table.add_column("op type")
        for name, op in zip(result.kept, result.kept_ops):
            table.add_row(name, op)
        console.print(table)
    if not result.met:
        console.print("[yellow]objective not met: the search stopped at --max-evals[/]")
    console.print(f"wrote {out}  (use it: mpgraph convert {model} --policy {out})", highlight=False, soft_wrap=True)
    if not result.met:
        raise typer.Exit(1)
