"""The ``mpgraph`` command line: the only part of mpgraph that prints.

Each command is a plain function in its own ``<name>_cmd.py`` that checks its flags, calls
the library, and prints the result (``console.console``; errors, notes and progress on
``console.err_console``). ``main.COMMANDS`` is the one table that registers them, behind the
error boundary ``main.handle_errors``. Library logic does not live here.

``main`` below is the ``mpgraph`` entry point: it imports nothing but the standard library
before it guards against Ctrl-C, so an interrupt while the command line loads is the same
``interrupted`` and exit code 130 as one during a command.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """Run the command line; Ctrl-C while typer, rich and the commands load exits 130."""
    try:
        from mpgraph.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    run()
