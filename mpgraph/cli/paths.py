"""Output options as typed: ``Path("out/")`` drops the slash that says "a folder".

``-o newdir/`` once wrote a file named ``newdir``: by the time a command saw the value, typer
had made it ``Path("newdir")``. Output options parse with ``output_path``, which keeps the
text as typed for ``checks.check_output_path`` to refuse a folder that does not exist.
(Stdlib only: every command module imports this at ``mpgraph --help`` time.)
"""

from __future__ import annotations

import os
from pathlib import Path, PosixPath, WindowsPath

__all__ = ["output_path", "typed_as"]

_Concrete = WindowsPath if os.name == "nt" else PosixPath


class _TypedPath(_Concrete):  # type: ignore[valid-type, misc]
    """A concrete path that also holds the text it was parsed from."""

    typed = ""


def output_path(value: str) -> Path:
    """typer ``parser`` of an output option: ``Path(value)`` remembering ``value``.

    >>> p = output_path("runs/")
    >>> p == Path("runs"), typed_as(p)
    (True, 'runs/')
    """
    path = _TypedPath(value)
    path.typed = value
    return path


def typed_as(path: Path) -> str:
    """What the user typed for ``path`` (``str(path)`` when it was not parsed by ``output_path``)."""
    return getattr(path, "typed", "") or str(path)
