"""CUDA-graph replay of a step: one capturing session specialised to a batch signature, with
fixed device buffers (a captured graph reads and writes the same addresses every replay).

The ``Executor`` builds one ``Replay`` at its first step (``start``) and runs steps through it
while batches keep that signature (``launch``); anything else runs in its plain session.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

__all__ = ["Launched", "Replay", "SYNC_RUNS_PER_GRAPH", "signature"]

#: Runs of each captured graph in sync before a pipelined executor enqueues it without ORT's
#: end-of-run sync (ORT captures a graph within its first runs, and a capture in a run that does
#: not synchronise failed on the DQN: CUDA error 901 at cudaStreamEndCapture).
SYNC_RUNS_PER_GRAPH = 2


def signature(batch: Mapping[str, np.ndarray], names: Iterable[str]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each named array's shape and dtype: what a captured graph is specialised to."""
    return {n: (np.shape(batch[n]), np.asarray(batch[n]).dtype) for n in names}


@dataclass
class Launched:
    """A step that ran, or was enqueued on a pipelined executor; the loop reads its result."""

    slot: int  # the state set it read; its loss and found_inf buffers have the same index
    batch: Mapping[str, np.ndarray]
    loss: ort.OrtValue
    found: ort.OrtValue | None
    event: Any = None  # pipelined: a CUDA event recorded after it
    start: float = 0.0
    step: int = 0
    position: tuple[int, int] | None = None  # fit: the data position before its batch


@dataclass
class Replay:
    """A session with CUDA graph capture, specialised to one batch signature, and the fixed
    device buffers its captured graphs read and write (addresses never change)."""

    session: ort.InferenceSession
    bindings: list[ort.IOBinding]  # indexed by state set: bindings[s] reads set s
    # Indexed by state set too: a pipelined step uploads its batch while the step before it
    # may still run, and its loss is read while the next step may write its own.
    batch: list[dict[str, ort.OrtValue]]
    signature: dict[str, tuple[tuple[int, ...], np.dtype]]
    loss: list[ort.OrtValue]
    found: list[ort.OrtValue | None]
    lr: ort.OrtValue | None
    options: list[tuple[ort.RunOptions, ort.RunOptions]]  # per state set: (synchronised, not)
    runs: int = 0  # steps run through it (each graph is captured in its first runs)

    def matches(self, batch: Mapping[str, np.ndarray]) -> bool:
        return signature(batch, self.batch[0]) == self.signature

    def upload(self, batch: Mapping[str, np.ndarray], slot: int) -> None:
        for name, buf in self.batch[slot].items():  # its last reader ran a full ring ago
            buf.update_inplace(np.ascontiguousarray(batch[name]))

    def nosync(self, pipelined: bool) -> bool:
        """Whether the next run may skip ORT's end-of-run sync (every graph captured)."""
        return pipelined and self.runs >= SYNC_RUNS_PER_GRAPH * len(self.bindings)


def run_options(ring: int) -> list[tuple[ort.RunOptions, ort.RunOptions]]:
    """Per state set: the run options of its captured graph, synchronised and not."""
    options = []
    for s in range(ring):
        pair = (ort.RunOptions(), ort.RunOptions())
        for o in pair:  # graph ids from 1: one captured graph per state set (0 is ORT's default)
            o.add_run_config_entry("gpu_graph_id", str(1 + s))
        pair[1].add_run_config_entry("disable_synchronize_execution_providers", "1")
        options.append(pair)
    return options
