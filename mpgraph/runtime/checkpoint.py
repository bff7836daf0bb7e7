"""Checkpoints of a training run: state arrays, step count, data position, lr, metrics history.

A checkpoint is one ``.npz``: the state arrays ``s0, s1, ...`` and a JSON ``__meta__`` with
``format``, the ``fingerprint`` of the graph (``graph_fingerprint``), ``steps``, the state
``names``, the data stream (``data``: position, seed, batch size and the data's digest) and
the ``lr``. The metrics history sits next
to it (``metrics_path``), appended at every checkpoint, so checkpoints stay the size of the
state however long the run.

Rules:

1. Files are written atomically: a reader never sees a partial checkpoint, and a failed
   write (a full disk) keeps the previous one and says which step it holds.
2. Reading checks the metadata key by key (type and range), then the fingerprint, the state
   names, every array's shape and dtype, and that every float state is finite, before
   anything is restored.
3. A checkpoint copied without its history file (or with a history that ends before its
   step) still resumes: the state alone continues the run bit for bit. What is lost is the
   record of the earlier steps' losses, so a warning says how many steps it misses; the
   resumed run's metrics, ``--metrics`` and ``--plot`` start after them.

Example:
    >>> metrics_path("runs/run.ckpt.npz").as_posix()
    'runs/run.ckpt.metrics.jsonl'
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph.errors import CheckpointError, OutputError
from mpgraph.io import write_atomic
from mpgraph.runtime.metrics import COLUMNS, Metrics

logger = logging.getLogger(__name__)

__all__ = ["graph_fingerprint", "metrics_path", "write_checkpoint", "read_checkpoint", "MetricsLog", "FORMAT"]

FORMAT = 2  # 2: metrics history in its own file (1 embedded it; still read)


def graph_fingerprint(model: ir.Model | onnx.ModelProto) -> str:
    """SHA-256 of a graph's interface and nodes, ignoring initializer values, docs and metadata.

    Two step graphs share a fingerprint when their inputs, outputs (names, types, shapes),
    opsets and nodes (op, domain, inputs, outputs, attributes) are equal, so a checkpoint
    taken on one can be resumed on the other.
    """
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    h = hashlib.sha256()
    for op in sorted((o.domain, o.version) for o in proto.opset_import):
        h.update(repr(op).encode())
    for group in (proto.graph.input, proto.graph.output):
        for v in group:
            h.update(v.name.encode() + b"\0" + v.type.SerializeToString(deterministic=True))
        h.update(b"\1")
    for node in proto.graph.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.ClearField("doc_string")
        n.ClearField("metadata_props")
        h.update(n.SerializeToString(deterministic=True))
    return h.hexdigest()[:32]


def metrics_path(checkpoint: str | os.PathLike[str]) -> Path:
    """The metrics history file of a checkpoint: ``run.ckpt.npz`` -> ``run.ckpt.metrics.jsonl``.

    One JSON record per line (``step``, ``loss``, ``loss_scale``, ``skipped``, ``seconds``),
    appended at every checkpoint; a resume keeps the records up to the checkpoint's step.
    """
    p = Path(checkpoint)
    return p.with_name(p.name.removesuffix(".npz") + ".metrics.jsonl")


class MetricsLog:
    """Appends a run's new metrics records to the history file of each checkpoint path."""

    def __init__(self) -> None:
        self._written: dict[Path, int] = {}

    def write(self, checkpoint: Path, metrics: Metrics) -> None:
        """Append the records since the last write to ``metrics_path(checkpoint)``; rewrite
        the file whole, atomically, the first time in this run or after a failed append.

        Raises:
            OutputError: The file cannot be written.
        """
        target = metrics_path(checkpoint)
        key = target.resolve()
        done = self._written.get(key)
        if done is None or not target.exists():
            lines = "".join(json.dumps(r) + "\n" for r in metrics.rows())
            write_atomic(target, lines.encode())
        else:
            rows = metrics.rows(done)
            if rows:
                try:
                    with open(target, "a", encoding="utf-8") as f:
                        f.write("".join(json.dumps(r) + "\n" for r in rows))
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:
                    self._written.pop(key, None)  # maybe a torn line: rewrite the file next time
                    raise OutputError(f"{target}: cannot write ({e.strerror or e})") from e
        self._written[key] = len(metrics)


def write_checkpoint(path: str | os.PathLike[str], meta: Mapping[str, Any], arrays: Sequence[np.ndarray],
                     metrics: Metrics, log: MetricsLog, last_step: int | None) -> None:
    """Write the metrics history, then the checkpoint (``meta`` plus ``FORMAT``), atomically.

    Args:
        path: The ``.npz`` to write.
        meta: ``fingerprint``, ``steps``, ``names``, ``data`` and ``lr``.
        arrays: The state arrays, in the order of ``meta["names"]``.
        metrics: The run's metrics so far.
        log: What this run already appended to the history file.
        last_step: The step of the last checkpoint written in this run, for the error.

    Raises:
        CheckpointError: A file cannot be written (a full disk): the previous checkpoint is
            left as it was, and the message gives its step.
    """
    doc = {"format": FORMAT, **meta}
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(json.dumps(doc).encode(), np.uint8),
             **{f"s{i}": a for i, a in enumerate(arrays)})
    try:
        log.write(Path(path), metrics)
        write_atomic(path, buf.getvalue())
    except OutputError as e:
        exists = Path(path).exists()
        kept = (f"the last good checkpoint (step {last_step}) is kept" if last_step is not None and exists
                else "the previous checkpoint file is kept" if exists
                else "no checkpoint of this run exists")
        raise CheckpointError(f"checkpoint at step {meta['steps']} not written: {e}; {kept}") from e


def read_checkpoint(path: str | os.PathLike[str], fingerprint: str,
                    want: Mapping[str, tuple[list[int], np.dtype | None]]) -> tuple[dict[str, Any], dict[str, np.ndarray], Metrics]:
    """Read and check a checkpoint of the graph with ``fingerprint``.

    Args:
        path: The ``.npz``.
        fingerprint: ``graph_fingerprint`` of the graph to restore into.
        want: State name -> (shape, dtype or ``None`` for any) the graph needs.

    Returns:
        The checked metadata, the state arrays by name, and the metrics history up to the
        checkpoint's step (from ``metrics_path(path)``, or a format-1 checkpoint itself).

    Raises:
        CheckpointError: Missing/unreadable file, bad metadata (naming the key), a state
            array of another shape or dtype, or a checkpoint of a different graph.
    """
    p = Path(path)
    meta, stored = _read_npz(p)
    if meta["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"{p}: checkpoint is from a different graph (fingerprint {meta['fingerprint']}, this graph "
            f"{fingerprint}); resume with the step graph it was saved from"
        )
    names = meta["names"]
    if sorted(names) != sorted(want):
        raise CheckpointError(f"{p}: checkpoint state names do not match the graph (missing "
                              f"{sorted(set(want) - set(names))[:5]}, extra {sorted(set(names) - set(want))[:5]})")
    arrays = {}
    for i, name in enumerate(names):
        if f"s{i}" not in stored:
            raise CheckpointError(f"{p}: checkpoint has no array s{i} for state '{name}'")
        arrays[name] = stored[f"s{i}"]
    for name, array in arrays.items():
        shape, dtype = want[name]
        if list(array.shape) != list(shape):
            raise CheckpointError(f"{p}: state '{name}' has shape {list(array.shape)}, the graph wants {shape}")
        if dtype is not None and array.dtype != np.dtype(dtype):
            raise CheckpointError(f"{p}: state '{name}' is {array.dtype}, the graph wants {np.dtype(dtype)}")
    for name, array in arrays.items():
        if array.dtype.kind in "biu":
            continue
        bad = int(np.count_nonzero(~np.isfinite(array)))
        if bad:  # such a run skips every step (loss scaling) or trains on NaN, with exit 0
            raise CheckpointError(f"{p}: state '{name}' holds {bad} non-finite value(s) (NaN or inf), so training "
                                  "cannot continue from it; resume from an earlier checkpoint")
    return meta, arrays, _history(p, meta)


def _read_npz(p: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The checked metadata and the arrays of a checkpoint file."""
    from mpgraph.data import read_npz

    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    arrays = read_npz(p, CheckpointError, what="an mpgraph checkpoint", hint=False)
    if "__meta__" not in arrays:
        raise CheckpointError(f"{p}: not an mpgraph checkpoint (no __meta__ array; it holds "
                              f"{', '.join(sorted(arrays)[:8])})")
    try:
        meta = json.loads(arrays["__meta__"].tobytes().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not an mpgraph checkpoint (metadata is not JSON: {e})") from e
    return _check_meta(meta, p), arrays


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_meta(meta: Any, p: Path) -> dict[str, Any]:
    """Checkpoint metadata with every key present and of the right type, else one line."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: checkpoint metadata is not a JSON object")
    fmt = meta.get("format")
    if fmt not in (1, FORMAT):
        raise CheckpointError(f"{p}: checkpoint format {fmt!r} is not {FORMAT}")
    for key, ok, what in (("fingerprint", lambda v: isinstance(v, str), "a string"),
                          ("steps", lambda v: _is_int(v) and v >= 0, "a step count >= 0"),
                          ("names", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                           "a list of state names")):
        if key not in meta:
            raise CheckpointError(f"{p}: checkpoint metadata has no '{key}' ({what})")
        if not ok(meta[key]):
            raise CheckpointError(f"{p}: checkpoint metadata '{key}' should be {what}, got {str(meta[key])[:60]!r}")
    data = meta.get("data")
    if data is not None and not (isinstance(data, dict) and all(_is_int(data.get(k)) and data[k] >= 0
                                                               for k in ("epoch", "index"))):
        raise CheckpointError(f"{p}: checkpoint metadata 'data' should hold integers epoch and index >= 0, "
                              f"got {str(data)[:80]!r}")
    for key, ok, what in (("seed", lambda v: _is_int(v), "an integer"), ("batch_size", lambda v: _is_int(v) and v >= 1,
                          "an integer >= 1"), ("digest", lambda v: isinstance(v, str), "a string")):
        if data is not None and key in data and not ok(data[key]):
            raise CheckpointError(f"{p}: checkpoint metadata 'data.{key}' should be {what}, got {str(data[key])[:40]!r}")
    lr = meta.get("lr")
    if lr is not None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise CheckpointError(f"{p}: checkpoint metadata 'lr' should be a finite number >= 0, got {str(lr)[:40]!r}")
        meta["lr"] = float(lr)
    return meta


def _history(p: Path, meta: Mapping[str, Any]) -> Metrics:
    """The metrics up to the checkpoint's step: its history file, else (format 1) its own."""
    history = _read_metrics_file(metrics_path(p), meta["steps"])
    if history is None and isinstance(meta.get("metrics"), Mapping):
        try:
            history = Metrics.from_dict(meta["metrics"])
        except (KeyError, TypeError, ValueError):
            history = None
    history = history if history is not None else Metrics()
    missing = meta["steps"] - len(history)
    if missing > 0:
        where = metrics_path(p)
        held = "is missing" if not where.exists() else f"holds {len(history)} of its {meta['steps']} steps"
        logger.warning("%s: its metrics history %s %s, so the losses of %d earlier step(s) are lost (the state resumes "
                       "bit for bit; the run's metrics, --metrics and --plot start after them); keep the .metrics.jsonl "
                       "next to the checkpoint when copying it", p, where, held, missing)
    return history


def _read_metrics_file(path: Path, steps: int) -> Metrics | None:
    """Records of steps ``<= steps`` from a metrics history file (a torn last line is ignored)."""
    if not path.is_file():
        return None
    rows: dict[int, dict[str, Any]] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if 0 < step <= steps:
            rows[step] = row
    ordered = [rows[k] for k in sorted(rows)]
    try:
        return Metrics.from_dict({k: [r.get(k) for r in ordered] for k in COLUMNS})
    except (TypeError, ValueError):
        return None
