"""Corpus exports, made once per test run, and gradient graphs' runs, once per process.

A dynamo export takes 2 to 5 s of torch tracing, and ``pytest -n 2 --dist worksteal`` gives
cases of one model to both processes (each gets a contiguous half of the test list and steals
from the other's end). So an export is written, under a file lock, to a directory the
processes share (``share``: the run's base temp); the second process waiting on the lock reads
the first one's file. The torch module is rebuilt in each process: ``models.build`` is seeded,
so it holds the weights the export was made from.

Without ``share`` (a script) each export is made once per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx

from . import check
from .models import build

_directory: Path | None = None


def share(base_temp: Path) -> None:
    """Keep exports under ``base_temp``'s run directory: the base temp itself, or its parent in
    an xdist worker (whose base temp is ``<run>/popen-gw<N>``), so that all workers of a run
    share it and no later run sees it."""
    global _directory
    run = base_temp.parent if os.environ.get("PYTEST_XDIST_WORKER") else base_temp
    _directory = run / "corpus-exports"
    _directory.mkdir(exist_ok=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # The exporters' warnings and mpgraph's own would flood the log; silence them for the
    # export only, and restore both (a global level left at ERROR hid later tests' warnings).
    mpgraph_logger = logging.getLogger("mpgraph")
    level = mpgraph_logger.level
    mpgraph_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        mpgraph_logger.setLevel(level)


@functools.cache
def exported(model: str, exporter: str) -> check.Exported:
    """``check.export(build(model), exporter)``, shared as the module docstring says.

    Raises:
        check.ExportFailed: torch cannot export it (remembered too).
    """
    case = build(model)
    if _directory is None:
        with _quiet():
            return check.export(case, exporter)
    path = _directory / f"{model}-{exporter}.onnx"
    failed = path.with_suffix(".failed")
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            raise check.ExportFailed(failed.read_text())
        if path.exists():
            proto = onnx.load_from_string(path.read_bytes())
            return check.Exported(case, exporter, proto, proto.graph.output[0].name, 0.0)
        try:
            with _quiet():
                made = check.export(case, exporter)
        except check.ExportFailed as e:
            failed.write_text(str(e))
            raise
        path.with_suffix(".part").write_bytes(made.model.SerializeToString())
        path.with_suffix(".part").replace(path)
        return made


@functools.cache
def gradient_run(model: str, exporter: str) -> check.GradientRun:
    """``check.gradient_run`` of the export: the grad and kernels checks read the same one."""
    return check.gradient_run(exported(model, exporter))
