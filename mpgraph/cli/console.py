"""Where the command line prints: results to stdout, errors, notes and progress to stderr."""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.markup import escape

__all__ = ["MessageHandler", "console", "err_console", "human_bytes"]


class _Console(Console):
    """Rich's console, except that text to a pipe or a file is never wrapped.

    A stream that is no terminal has no width, so Rich breaks lines at 80 columns, mid-phrase;
    a log or ``| grep`` wants each message on its line. Tables keep their layout.
    """

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        if soft_wrap is None and not self.is_terminal:
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)


console: Console = _Console()
err_console: Console = _Console(stderr=True)


class MessageHandler(logging.Handler):
    """The library's log records as the command line's own lines on stderr: ``warning: ...``,
    ``error: ...``, like every message the commands print themselves (not ``WARNING
    mpgraph.policy.loader: ...``). Records below ``WARNING`` are dropped.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        label = "[bold red]error:[/]" if record.levelno >= logging.ERROR else "[yellow]warning:[/]"
        try:
            err_console.print(f"{label} {escape(record.getMessage())}", highlight=False)
        except Exception:  # noqa: BLE001 - logging's contract: a failing handler reports, never raises
            self.handleError(record)


def human_bytes(n: int | None) -> str:
    """A byte count for people; ``?`` when unknown.

    >>> human_bytes(512), human_bytes(3 * 2**20), human_bytes(None)
    ('512 B', '3.00 MiB', '?')
    """
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"
