"""``mpgraph policy init``: a commented copy of a preset (or policy file) to edit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "policy_init"]


def policy_init(
    source: Annotated[str, typer.Argument(help="Preset name (bf16, fp16, ...) or a policy YAML to start from.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The YAML file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")] = False,
) -> None:
    """Write a self-contained, commented copy of a policy to edit, then use with --policy OUTPUT."""
    from rich.console import Console

    from mpgraph.errors import UsageError
    from mpgraph.io import write_atomic
    from mpgraph.policy import list_presets, load_policy
    from mpgraph.policy.writer import policy_yaml

    if output.exists() and not force:
        raise UsageError(f"{output}: exists; pass --force to overwrite it")
    policy = load_policy(source)
    label = f"preset {source}" if source in list_presets() else str(source)
    write_atomic(output, policy_yaml(policy, name=output.stem, source=label).encode("utf-8"))
    Console().print(
        f"wrote {output} ({label}, {policy.dtype.name.lower()}, {len(policy.ops)} ops listed); "
        f"edit it, then: mpgraph convert MODEL --policy {output}",
        highlight=False, soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add ``policy init`` to the ``policy`` command group of ``app``."""
    command = policy_init
    try:  # the shared wrapper turns MpgraphError into one line and exit code 2
        from mpgraph.cli.main import handle_errors, policy_app
    except ImportError:
        return
    policy_app.command("init")(handle_errors(command))
