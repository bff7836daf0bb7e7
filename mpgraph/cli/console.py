"""Where the command line prints: results to stdout, errors, notes and progress to stderr."""

from __future__ import annotations

from rich.console import Console

__all__ = ["console", "err_console", "human_bytes"]

console = Console()
err_console = Console(stderr=True)


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
