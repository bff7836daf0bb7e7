"""Checks of user values at the command-line edge, before any work starts.

Each check raises an ``MpgraphError`` subclass with one line that names the flag, the value
and what would be valid; the commands' error boundary prints it and exits with code 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnx_ir as ir

from mpgraph.errors import DataError, UsageError

__all__ = ["check_output_path", "read_inputs_npz", "finite", "positive_int"]


def finite(value: float, flag: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
    """``value`` if it is finite and in range, else a ``UsageError`` naming ``flag``.

    >>> finite(0.1, "--lr", low=0.0)
    0.1
    >>> finite(float("nan"), "--lr")
    Traceback (most recent call last):
    ...
    mpgraph.errors.UsageError: --lr must be a finite number, got nan
    """
    if not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise UsageError(f"{flag} must be {'>' if low_open else '>='} {low:g}, got {value:g}")
    if high is not None and value > high:
        raise UsageError(f"{flag} must be <= {high:g}, got {value:g}")
    return value


def positive_int(value: int, flag: str, *, minimum: int = 1) -> int:
    """``value`` if it is at least ``minimum``, else a ``UsageError`` naming ``flag``."""
    if value < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {value}")
    return value


def check_output_path(path: Path | None, flag: str) -> None:
    """``path`` can be written: its folder exists and takes a file (probed), it is no folder,
    and it was not typed as one (``out/``, ``paths.output_path``)."""
    if path is None:
        return
    from mpgraph.cli.paths import typed_as
    from mpgraph.errors import OutputError
    from mpgraph.io import check_writable

    typed = typed_as(path)
    if typed.endswith(("/", os.sep)) and not path.is_dir():
        raise OutputError(f"{flag} {typed}: names a folder (a trailing '/') that does not exist; create the folder "
                          "and name a file in it, or drop the '/' to write a file")
    check_writable(path, flag)


def read_inputs_npz(path: Path, model: ir.Model, flag: str) -> dict[str, np.ndarray]:
    """Arrays of an inputs ``.npz`` checked against the graph's data inputs.

    Keys must name graph inputs that are not initializers; every such input needs one; an
    array's rank and kind (float or integer) must fit the input; every array has samples and
    finite values (``data.check_inputs``). Messages list the keys the file has and the inputs
    the graph wants.

    Raises:
        DataError: Unreadable file, keys/ranks/kinds that do not fit, no samples, NaN or inf.
    """
    from mpgraph.data import check_inputs, read_npz

    arrays = read_npz(path)
    inits = set(model.graph.initializers)
    wanted = {v.name: v for v in model.graph.inputs if v.name and v.name not in inits}
    missing = sorted(set(wanted) - set(arrays))
    extra = sorted(set(arrays) - set(wanted))
    if missing or extra:
        raise DataError(
            f"{flag} {path}: keys do not match the graph's inputs (file has {', '.join(sorted(arrays)) or 'no keys'}; "
            f"graph wants {', '.join(sorted(wanted)) or 'none'}"
            + (f"; missing {', '.join(missing)}" if missing else "") + (f"; unknown {', '.join(extra)}" if extra else "") + ")"
        )
    for name, value in wanted.items():
        a = arrays[name]
        if value.shape is not None and a.ndim != len(value.shape):
            raise DataError(f"{flag} {path}: '{name}' has rank {a.ndim} (shape {list(a.shape)}), the graph wants "
                            f"rank {len(value.shape)} ({list(value.shape)})")
        if value.dtype is not None:
            want_float = value.dtype.is_floating_point()
            if a.dtype.kind not in "biuf":
                raise DataError(f"{flag} {path}: '{name}' is {a.dtype}, not numeric")
            if want_float != (a.dtype.kind == "f"):
                raise DataError(f"{flag} {path}: '{name}' is {a.dtype}, the graph wants {value.dtype.name.lower()}")
            if a.dtype != np.dtype(value.dtype.numpy()):
                arrays[name] = a.astype(value.dtype.numpy())
    check_inputs(arrays, f"{flag} {path}")
    return arrays
