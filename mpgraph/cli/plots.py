"""Plots the CLI draws: ``mpgraph train --plot``'s loss curves (matplotlib, optional)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mpgraph.errors import MpgraphError
from mpgraph.io import write_atomic
from mpgraph.runtime.metrics import Metrics

__all__ = ["plot_losses"]


def plot_losses(runs: Mapping[str, Metrics | Mapping[str, Any]], path: str | os.PathLike[str], *,
                title: str | None = None) -> None:
    """Draw the loss curves of several runs in one PNG (skipped steps marked with x).

    Args:
        runs: Label -> ``Metrics`` (or its ``to_dict()``).
        path: Output ``.png`` (written atomically).
        title: Figure title.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MpgraphError("plotting needs matplotlib: pip install 'mpgraph[data]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    positive = True
    try:
        for label, m in runs.items():
            d = m.to_dict() if isinstance(m, Metrics) else m
            steps = np.asarray(d["step"])
            loss = np.asarray([math.nan if x is None else x for x in d["loss"]], dtype=np.float64)
            positive = positive and bool(np.all(loss[np.isfinite(loss)] > 0))
            line, = ax.plot(steps, loss, label=label, linewidth=1.2)
            skipped = np.asarray(d["skipped"], dtype=bool)
            if skipped.any():
                y = np.where(np.isfinite(loss[skipped]), loss[skipped], np.nanmax(loss) if np.isfinite(loss).any() else 1.0)
                ax.scatter(steps[skipped], y, marker="x", color=line.get_color(), s=16, label=f"{label}: skipped")
        if positive:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if title:
            ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    write_atomic(path, buf.getvalue())
