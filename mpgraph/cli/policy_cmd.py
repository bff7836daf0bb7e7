"""``mpgraph policy show|list|check|init``: show, list, validate and copy precision policies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mpgraph.cli.console import console
from mpgraph.cli.paths import output_path

__all__ = ["policy_show", "policy_list", "policy_check", "policy_init"]


def policy_show(name: Annotated[str, typer.Argument(help="Preset name or YAML path.")]) -> None:
    """Print a policy (preset or file), fully resolved."""
    from mpgraph.policy import load_policy

    pol = load_policy(name)
    console.print(f"[bold]{pol.name}[/]: dtype {pol.dtype.name.lower()}, unlisted ops: {pol.default_category}")
    if pol.description:
        console.print(pol.description)
    table = Table()
    for col in ("category", "op type", "reason"):
        table.add_column(col)
    for category in ("allow", "infer", "clear", "deny"):
        for op_type, (cat, reason) in sorted(pol.ops.items()):
            if cat == category:
                table.add_row(category, op_type, reason)
    if pol.ops:
        console.print(table)
    for override in pol.overrides:
        console.print(f"override {override.pattern!r} -> {override.precision}: {override.reason}")
    for pin in pol.pins:
        console.print(f"pin {pin.op_type} inputs {list(pin.inputs)}: {pin.reason}")
    console.print(f"keep_io_types: {pol.keep_io_types}   initializers: {pol.initializers}")
    console.print(f"loss_scaling: {pol.loss_scaling}")


def policy_list() -> None:
    """List the presets."""
    from mpgraph.policy import list_presets, load_policy

    for name in list_presets():
        pol = load_policy(name)
        console.print(f"{name:16s} {pol.dtype.name.lower():9s} loss scaling: {pol.loss_scaling.mode}")


def policy_check(path: Annotated[Path, typer.Argument(help="Policy YAML file.")]) -> None:
    """Validate a policy file; errors name file, line, key path, bad value and valid choices."""
    from mpgraph.policy import load_policy_file

    pol = load_policy_file(path)
    console.print(f"{path}: ok ({pol.dtype.name.lower()}, {len(pol.ops)} ops listed)")


def policy_init(
    source: Annotated[str, typer.Argument(help="Preset name (bf16, fp16, ...) or a policy YAML to start from.")],
    output: Annotated[Path, typer.Option("--output", "-o", parser=output_path, metavar="PATH", help="The YAML file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")] = False,
) -> None:
    """Write a self-contained, commented copy of a policy to edit, then use with --policy OUTPUT."""
    from mpgraph.cli.checks import check_output_path
    from mpgraph.errors import UsageError
    from mpgraph.io import write_atomic
    from mpgraph.policy import list_presets, load_policy
    from mpgraph.policy.writer import policy_yaml

    check_output_path(output, "-o")
    if output.suffix.lower() not in (".yaml", ".yml"):
        raise UsageError(f"-o {output}: a policy is YAML; name the file .yaml or .yml")
    if output.exists() and not force:
        raise UsageError(f"{output}: exists; pass --force to overwrite it")
    policy = load_policy(source)
    label = f"preset {source}" if source in list_presets() else str(source)
    write_atomic(output, policy_yaml(policy, name=output.stem, source=label).encode("utf-8"))
    console.print(
        f"wrote {output} ({label}, {policy.dtype.name.lower()}, {len(policy.ops)} ops listed); "
        f"edit it, then: mpgraph convert MODEL --policy {output}",
        highlight=False, soft_wrap=True,
    )
