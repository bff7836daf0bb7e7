"""What a training run records: one ``StepResult`` per step, collected in ``Metrics``.

Example:
    >>> m = Metrics()
    >>> m.append(1, StepResult(loss=2.5, loss_scale=None, skipped=False, seconds=0.01))
    >>> m.append(2, StepResult(loss=float("nan"), loss_scale=None, skipped=True, seconds=0.0))
    >>> m.summary()["last_loss"], m.summary()["nonfinite_losses"], m.summary()["skipped"]
    (None, 1, 1)
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpgraph.io import write_atomic

__all__ = ["StepResult", "Metrics", "COLUMNS"]

#: The per-step columns, in file order.
COLUMNS = ("step", "loss", "loss_scale", "skipped", "seconds")


def _clean(x: float | None) -> float | None:
    """``None`` for a missing or non-finite float (valid JSON), else ``x``."""
    return None if x is None or not math.isfinite(x) else x


@dataclass(frozen=True)
class StepResult:
    """What one step reports.

    Attributes:
        loss: The step's loss (float32 graph output, as a Python float).
        loss_scale: The loss scale this step used (``None`` without loss scaling).
        skipped: True when the graph found inf/NaN gradients and skipped the update.
        seconds: Wall time of the step (binding, run, reading the loss).
    """

    loss: float
    loss_scale: float | None
    skipped: bool
    seconds: float


@dataclass
class Metrics:
    """Per-step records of a run: ``step`` (1-based), ``loss``, ``loss_scale``, ``skipped``,
    ``seconds``. Written as CSV or JSON; ``mpgraph train --plot`` draws them."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    loss_scale: list[float | None] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def append(self, step: int, result: StepResult) -> None:
        self.step.append(step)
        self.loss.append(result.loss)
        self.loss_scale.append(result.loss_scale)
        self.skipped.append(result.skipped)
        self.seconds.append(result.seconds)

    def __len__(self) -> int:
        return len(self.step)

    def to_dict(self) -> dict[str, list[Any]]:
        """Columns as lists; non-finite floats become ``None`` (valid JSON)."""
        return {
            "step": list(self.step),
            "loss": [_clean(x) for x in self.loss],
            "loss_scale": [_clean(x) for x in self.loss_scale],
            "skipped": list(self.skipped),
            "seconds": list(self.seconds),
        }

    def rows(self, start: int = 0) -> list[dict[str, Any]]:
        """Records ``start:`` as JSON-ready dicts (non-finite floats as ``None``)."""
        d = self.to_dict()
        return [{k: d[k][i] for k in d} for i in range(start, len(self))]

    def truncate(self, steps: int) -> None:
        """Keep only the records of steps ``<= steps``."""
        keep = [i for i, s in enumerate(self.step) if s <= steps]
        for name in COLUMNS:
            column = getattr(self, name)
            setattr(self, name, [column[i] for i in keep])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Metrics:
        return cls(
            [int(s) for s in d["step"]],
            [math.nan if x is None else float(x) for x in d["loss"]],
            [None if x is None else float(x) for x in d["loss_scale"]],
            [bool(x) for x in d["skipped"]],
            [float(x) for x in d["seconds"]],
        )

    def summary(self) -> dict[str, Any]:
        """Steps, first/last loss, skipped steps, final scale, median steps per second.

        A non-finite loss or scale reads ``None`` (so the JSON stays valid); ``nonfinite_losses``
        counts them.
        """
        secs = sorted(self.seconds)
        return {
            "steps": len(self),
            "first_loss": _clean(self.loss[0]) if self.loss else None,
            "last_loss": _clean(self.loss[-1]) if self.loss else None,
            "nonfinite_losses": sum(not math.isfinite(x) for x in self.loss),
            "skipped": int(sum(self.skipped)),
            "loss_scale": _clean(self.loss_scale[-1]) if self.loss_scale else None,
            "steps_per_s": 1.0 / secs[len(secs) // 2] if secs and secs[len(secs) // 2] > 0 else None,
        }

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write ``step,loss,loss_scale,skipped,seconds`` rows (atomically)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(COLUMNS)
        for row in zip(self.step, self.loss, self.loss_scale, self.skipped, self.seconds):
            s, loss, scale, skipped, secs = row
            w.writerow([s, repr(loss), "" if scale is None else repr(scale), int(skipped), f"{secs:.6g}"])
        write_atomic(path, buf.getvalue().encode())

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write ``{"summary": ..., "metrics": {column: [...]}}`` (atomically)."""
        doc = {"summary": self.summary(), "metrics": self.to_dict()}  # summary() and to_dict() drop NaN
        write_atomic(path, (json.dumps(doc, allow_nan=False) + "\n").encode())
