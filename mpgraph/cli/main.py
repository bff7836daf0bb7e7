"""The ``mpgraph`` command line. Only this package prints; the library logs.

Every command is a plain function in its own ``mpgraph/cli/<name>_cmd.py``; ``COMMANDS``
below is the one place that names them, in the order ``mpgraph --help`` lists them, and
wraps each in the error boundary ``handle_errors``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape

from mpgraph.cli.advise_cmd import advise_scale_command
from mpgraph.cli.audit_cmd import audit_command
from mpgraph.cli.check_grad_cmd import check_grad_command
from mpgraph.cli.compare_cmd import compare_command
from mpgraph.cli.console import console, err_console
from mpgraph.cli.convert_cmd import convert
from mpgraph.cli.export_cmd import export_command
from mpgraph.cli.kernels_cmd import kernels_command
from mpgraph.cli.policy_cmd import policy_check, policy_init, policy_list, policy_show
from mpgraph.cli.targets_cmd import targets_command
from mpgraph.cli.train_cmd import train
from mpgraph.cli.train_graph_cmd import train_graph_command
from mpgraph.cli.tune_cmd import tune_command
from mpgraph.errors import MpgraphError, first_line

__all__ = ["app", "main", "handle_errors", "COMMANDS", "console", "err_console"]

F = TypeVar("F", bound=Callable[..., Any])

#: What typer itself raises inside a command (an exit code, an abort, a usage error): it passes
#: the boundary untouched for typer to handle. Named through typer, never click: recent typers
#: vendor click and no longer depend on it, so ``import click`` fails on a plain install.
_TYPER_SIGNALS = (typer.Exit, typer.Abort, typer.BadParameter)

#: ``--debug`` (or ``MPGRAPH_DEBUG=1``): let unexpected exceptions show their traceback.
DEBUG = os.environ.get("MPGRAPH_DEBUG", "") not in ("", "0")


def _say_error(text: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(text)}", markup=True, highlight=False, soft_wrap=True)


def _os_error_line(e: OSError) -> str:
    where = e.filename if e.filename is not None else None
    what = e.strerror or str(e) or type(e).__name__
    return f"{where}: {what}" if where is not None else what


def handle_errors(fn: F) -> F:
    """The error boundary of every command.

    1. ``MpgraphError`` (bad input a command foresaw): one ``error:`` line, exit code 2.
    2. ``OSError`` (disk full, permission denied, read-only file system) and ``MemoryError``:
       one line naming the file and the system's reason, exit code 2.
    3. Ctrl-C: ``interrupted``, exit code 130.
    4. Anything else is a bug in mpgraph: one line, the hint to rerun with ``--debug``, exit
       code 1; with ``--debug`` (or ``MPGRAPH_DEBUG=1``) the traceback instead.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _TYPER_SIGNALS:
            raise
        except MpgraphError as e:
            if DEBUG:
                raise
            _say_error(str(e))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None
        except OSError as e:
            if DEBUG:
                raise
            _say_error(_os_error_line(e))
            raise typer.Exit(2) from None
        except MemoryError:
            if DEBUG:
                raise
            _say_error("out of memory")
            raise typer.Exit(2) from None
        except Exception as e:  # noqa: BLE001 - the boundary: an unforeseen failure is a bug
            if DEBUG:
                raise
            _say_error(f"internal error: {type(e).__name__}: {first_line(e)} (run with --debug for the traceback)")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


#: Every command as (group, name, function): group ``""`` is the top level, ``policy`` the
#: ``mpgraph policy ...`` group. Top-level commands are listed in this order, groups after.
COMMANDS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("", "convert", convert),
    ("", "audit", audit_command),
    ("", "compare", compare_command),
    ("", "train-graph", train_graph_command),
    ("", "export", export_command),
    ("", "train", train),
    ("", "check-grad", check_grad_command),
    ("", "tune", tune_command),
    ("", "advise-scale", advise_scale_command),
    ("", "targets", targets_command),
    ("", "kernels", kernels_command),
    ("policy", "show", policy_show),
    ("policy", "list", policy_list),
    ("policy", "check", policy_check),
    ("policy", "init", policy_init),
)

#: The help line of each command group.
GROUPS = {"policy": "Show and check precision policies."}


def _build_app() -> typer.Typer:
    root = typer.Typer(
        name="mpgraph",
        help="Compile precision policies onto ONNX graphs; train and audit the result.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    groups = {"": root}
    for group, text in GROUPS.items():
        groups[group] = typer.Typer(help=text, no_args_is_help=True)
        root.add_typer(groups[group], name=group)
    for group, name, command in COMMANDS:
        groups[group].command(name)(handle_errors(command))
    root.callback()(_root)
    return root


def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an unexpected error (a bug in mpgraph).")] = False,
) -> None:
    """Compile precision policies onto ONNX graphs; train and audit the result."""
    global DEBUG
    if debug:
        DEBUG = True


app = _build_app()


def main() -> None:
    from mpgraph.cli.console import MessageHandler

    try:
        logging.basicConfig(level=logging.WARNING, handlers=[MessageHandler()])
        app()
    except KeyboardInterrupt:  # while typer builds the commands, before their error boundary
        err_console.print("[bold red]interrupted[/]")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
