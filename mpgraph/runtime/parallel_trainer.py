"""``DataParallelTrainer``: the training loop over a ``DataParallelExecutor``.

The loop is the one-process ``Trainer``'s (``loop.TrainingLoop``: ``step``, ``step_many``,
``fit`` with its data stream, metrics, non-finite handling and ``stop``); only the executor
differs. Every rank builds the trainer from the same step graph and calls the same methods
with the same **global** batches (or the same dataset and seed): the executor runs this rank's
slice of each. Checkpoints are collective: every rank calls ``save_checkpoint``, the executor
gathers the whole state (sharded moments included) to rank 0, which writes the one-process
checkpoint format (fingerprint, step count, data position, lr, metrics), atomically, and every
rank learns whether it could. Every rank calls ``load_checkpoint`` on the same file and keeps
its share, so a run resumes on any world size (and in a one-process ``Trainer``).

Example (one process: world size 1):
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05)
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((64, 4)).astype(np.float32)
    >>> trainer = DataParallelTrainer(step, RunOptions(threads=1), DataParallelOptions(micro_batches=2))
    >>> metrics = trainer.fit({"x": x, "label": (x[:, 0] > 0).astype(np.int64)}, steps=20, batch_size=32)
    >>> metrics.loss[-1] < metrics.loss[0], trainer.world
    (True, 1)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from mpgraph.errors import CheckpointError, UsageError
from mpgraph.io import ModelLike, as_model
from mpgraph.runtime.loop import TrainingLoop
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.parallel_executor import DataParallelExecutor, DataParallelOptions
from mpgraph.runtime.program import Program
from mpgraph.runtime.trainer import Trainer

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["DataParallelTrainer"]


class DataParallelTrainer(TrainingLoop):
    """The training loop of one rank of a data-parallel run (see the module).

    Args:
        model: The step graph (the same on every rank).
        options: How the sessions run (``provider`` ``cpu``; ``threads``, ``kernels``).
        parallel: Buckets, reduction, micro-batches, optimizer sharding.
        group: The process group (``None``: the default one if initialized, else alone).
        state: Initial state values instead of the graph's initializers.
    """

    executor: DataParallelExecutor

    def __init__(self, model: ModelLike, options: RunOptions | None = None,
                 parallel: DataParallelOptions | None = None, group: torch.distributed.ProcessGroup | None = None,
                 state: Mapping[str, np.ndarray] | None = None) -> None:
        self.options = options or RunOptions()
        if self.options.inplace_state:
            raise UsageError("inplace_state=True needs a one-device Trainer: data-parallel steps keep two state sets")
        self.program = Program(as_model(model), state)
        self.executor = DataParallelExecutor(self.program, self.options, parallel, group)
        self._start_loop()

    @property
    def rank(self) -> int:
        return self.executor.rank

    @property
    def world(self) -> int:
        return self.executor.world

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The whole state (collective: every rank must read it; sharded moments are gathered)."""
        return self.executor.gather_state(everyone=True) or {}

    def predict(self, arrays: Mapping[str, np.ndarray], batch_size: int = 512) -> np.ndarray:
        """``Trainer.predict``: logits of the forward model on ``arrays`` (on this rank, all of
        them: every rank holds the parameters)."""
        return self.executor.predict(arrays, self._settled()[0], batch_size)

    #: ``Trainer.evaluate``: classification accuracy of the current parameters on ``arrays``.
    evaluate = Trainer.evaluate

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """``Trainer.save_checkpoint``, collectively: every rank calls it, rank 0 writes.

        Raises:
            CheckpointError: On every rank, when rank 0 could not write (the previous file stays).
        """
        error = [""]
        try:
            super().save_checkpoint(path)
        except CheckpointError as e:
            error = [str(e)]
        if self.world > 1:
            self.executor.broadcast_object_list(error)
        if error[0]:
            raise CheckpointError(error[0])

    def _checkpoint_arrays(self, state: Mapping[str, ort.OrtValue]) -> list[np.ndarray] | None:
        whole = self.executor.gather_state(everyone=False)
        return None if whole is None else [whole[name] for name, _ in self.program.pairs]

    def _state_specs(self) -> dict[str, tuple[list[int], np.dtype | None]]:
        # The checkpoint holds the whole state; a rank's own buffers may hold a slice of it.
        return {name: (list(a.shape), a.dtype) for name, a in self.program.initial.items()}
