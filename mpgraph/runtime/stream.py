"""The training loop's state between steps: step count, metrics, the data stream, checkpoints.

``DataStream`` is the base of ``loop.TrainingLoop``: it holds what a checkpoint must carry so
that a resumed run continues the uninterrupted one bit for bit (the state buffers, the step
count, the data position, the lr, the metrics history) and refuses a resume that would not
(another graph, seed, batch size or dataset).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from mpgraph.data import Batches, Dataset, data_digest
from mpgraph.errors import CheckpointError
from mpgraph.runtime import providers
from mpgraph.runtime.checkpoint import MetricsLog, read_checkpoint, write_checkpoint
from mpgraph.runtime.metrics import Metrics

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mpgraph.runtime.executor import Executor
    from mpgraph.runtime.program import Program
    from mpgraph.runtime.replay import Launched

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_SEED", "DataStream"]

#: ``fit``'s batch size and shuffle seed when neither the call nor a resumed checkpoint gives one.
DEFAULT_BATCH_SIZE, DEFAULT_SEED = 64, 0


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class DataStream:
    """Step count, metrics, data stream and checkpoints of a run over ``self.executor``."""

    program: Program
    executor: Executor
    has_loss_scale: bool

    def _init_loop_state(self) -> None:
        """What the training loop tracks between steps: counts, metrics, the data stream."""
        self.steps = 0
        self.metrics = Metrics()
        self._inflight: list[Launched] = []  # launched steps whose results are not read yet
        self._marks: dict[int, tuple[int, int]] | None = None
        self._batches: Batches | None = None
        self._batches_source: Any = None
        self._pending_position: tuple[int, int] | None = None
        #: The data stream of the checkpoint loaded last (its ``data`` record and path), which
        #: the next ``fit`` on a dataset must continue.
        self._resumed: tuple[dict[str, Any], str] | None = None
        self._metrics_log = MetricsLog()
        #: The step of the last checkpoint written (``None``: none yet in this run).
        self.last_checkpoint_step: int | None = None

    def _settled(self) -> tuple[dict[str, ort.OrtValue], int]:
        """The state and step count after the last finished step (pipelined steps may be in
        flight: the oldest one still reads the state its predecessor left)."""
        if self._inflight:
            return self.executor.state_set(self._inflight[0].slot), self._inflight[0].step - 1
        return self.executor.state_set(), self.steps

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Current state values (host copies), by state input name."""
        state, _ = self._settled()
        return {name: state[name].numpy().copy() for name, _ in self.program.pairs}

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` without loss scaling."""
        if self.program.scale_name is None:
            return None
        return float(self._settled()[0][self.program.scale_name].numpy().reshape(-1)[0])

    # -- the data stream ------------------------------------------------------------------

    def stream_settings(self, batch_size: int | None = None, seed: int | None = None) -> tuple[int, int]:
        """The batch size and shuffle seed ``fit`` uses: the given ones, else those of the
        checkpoint loaded last (so its data stream goes on), else 64 and 0.

        Raises:
            CheckpointError: A given seed differs from the resumed checkpoint's: the run would
                not continue the stream the checkpoint was taken in. (A batch size is checked
                with the data, ``check_resumed_data``: a split smaller than it clamps it.)
        """
        recorded = self._resumed[0] if self._resumed is not None else {}
        wanted = {"batch_size": batch_size, "seed": seed}
        if seed is not None and _is_count(recorded.get("seed")) and seed != recorded["seed"]:
            self._stream_differs(f"seed {seed} (the checkpoint's run used {recorded['seed']})", "--seed")

        def pick(key: str, default: int) -> int:
            if wanted[key] is not None:
                return int(wanted[key])  # type: ignore[arg-type]
            return int(recorded[key]) if _is_count(recorded.get(key)) else default

        return pick("batch_size", DEFAULT_BATCH_SIZE), pick("seed", DEFAULT_SEED)

    def _stream_differs(self, what: str, flag: str) -> None:
        assert self._resumed is not None
        raise CheckpointError(
            f"{self._resumed[1]}: resuming with {what} would not continue its data stream, so the run would "
            f"differ from the uninterrupted one; leave {flag} out to use the checkpoint's, or start a new run "
            "without resuming")

    def check_resumed_data(self, data: Dataset | Mapping[str, np.ndarray], batch_size: int | None = None) -> None:
        """``data`` is what the checkpoint loaded last was trained on (its ``data_digest``),
        batched as it was (``batch_size``, ``None``: the checkpoint's).

        Raises:
            CheckpointError: Other arrays (another file, other generated data): naming both
                digests and the sizes; or another batch size.
        """
        if self._resumed is None:
            return
        recorded = self._resumed[0]
        source = data.train if isinstance(data, Dataset) else data
        n = len(next(iter(source.values()))) if source else 0
        if batch_size is not None and _is_count(recorded.get("batch_size")) \
                and min(batch_size, n) != recorded["batch_size"]:
            self._stream_differs(f"batch size {batch_size} (the checkpoint's run used {recorded['batch_size']})",
                                 "--batch")
        if not isinstance(recorded.get("digest"), str):
            return
        digest = data_digest(source)
        if digest != recorded["digest"]:
            raise CheckpointError(
                f"{self._resumed[1]}: the training data differs from the checkpoint's run (data digest "
                f"{self._resumed[0]['digest']}, this data {digest}, {n} samples), so the run would differ from the "
                "uninterrupted one; resume with the same --data (and, for generated data, the same --seed)")

    def _batches_for(self, data: Dataset | Mapping[str, np.ndarray], batch_size: int | None,
                     seed: int | None) -> Batches:
        source = data.train if isinstance(data, Dataset) else data
        batch_size, seed = self.stream_settings(batch_size, seed)
        b = self._batches
        if b is None or self._batches_source is not source or b.batch_size != min(batch_size, b.n) or b.seed != seed:
            self.check_resumed_data(data, batch_size)
            position = self._pending_position or (0, 0)
            b = self._batches = Batches(source, batch_size, seed, position)
            self._batches_source = source
            self._pending_position = None
            if self._resumed is not None and isinstance(self._resumed[0].get("digest"), str):
                b._digest = self._resumed[0]["digest"]  # checked equal just now
            self._resumed = None
        return b

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write all state, the step count, data position, lr and the graph fingerprint to
        ``path`` (an ``.npz``), atomically: a reader never sees a partial file. The metrics
        history goes to ``metrics_path(path)`` first (appended).

        Raises:
            CheckpointError: The file cannot be written (a full disk): the previous checkpoint
                is left as it was, and the message gives its step.

        Called from ``fit``'s callback on a pipelined trainer, it writes the step just
        reported: the step in flight after it, and its batch, are not in the checkpoint.
        """
        state, steps = self._settled()
        data = self._batches.state() if self._batches is not None else None
        if data is not None and self._inflight and self._inflight[0].position is not None:
            data["epoch"], data["index"] = self._inflight[0].position
        pairs = self.program.pairs
        meta = {"fingerprint": self.program.fingerprint, "steps": steps, "names": [name for name, _ in pairs],
                "data": data, "lr": self.executor.lr}
        arrays = self._checkpoint_arrays(state)
        if arrays is not None:
            write_checkpoint(path, meta, arrays, self.metrics, self._metrics_log, self.last_checkpoint_step)
        self.last_checkpoint_step = steps

    def _checkpoint_arrays(self, state: Mapping[str, ort.OrtValue]) -> list[np.ndarray] | None:
        """The whole state in ``pairs`` order, as a checkpoint holds it (``None``: this process
        writes no file; a data-parallel rank other than 0, whose executor gathers the state)."""
        return [state[name].numpy() for name, _ in self.program.pairs]

    def _state_specs(self) -> dict[str, tuple[list[int], np.dtype | None]]:
        """Shape and dtype of every state value, as a checkpoint must hold it."""
        current = self.executor.state_set()
        return {name: (current[name].shape(), providers.ORT_TYPES.get(current[name].data_type()))
                for name, _ in self.program.pairs}

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by ``save_checkpoint`` for this same graph.

        Metadata is checked key by key (type and range) before anything is restored; the
        metrics history comes from ``metrics_path(path)`` (or, for a format-1 checkpoint, from
        the checkpoint itself).

        Raises:
            CheckpointError: Missing/unreadable file, bad metadata (naming the key), a state
                array of another shape or dtype, or a checkpoint of a different graph.
        """
        meta, arrays, self.metrics = read_checkpoint(path, self.program.fingerprint, self._state_specs())
        self.executor.set_state(arrays)
        self.steps = meta["steps"]
        self._metrics_log = MetricsLog()
        self.last_checkpoint_step = self.steps
        data = meta.get("data")
        self._batches = None
        self._pending_position = (data["epoch"], data["index"]) if data else None
        self._resumed = (dict(data), str(path)) if data else None
        self.executor.forget_lr()
        if meta.get("lr") is not None:
            self.executor.bind_lr(meta["lr"])
