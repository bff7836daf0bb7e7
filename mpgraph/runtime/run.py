"""A run that never loses its work: signals, periodic checkpoints, one-line ORT errors.

``run_training`` drives a trainer's ``fit`` (``mpgraph.runtime.loop``) as ``mpgraph train``
runs it; ``stop_on_signals`` turns SIGINT/SIGTERM into a stop request between steps.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from mpgraph.data import Dataset
from mpgraph.errors import CheckpointError, MpgraphError, TrainingError
from mpgraph.runtime import providers
from mpgraph.runtime.metrics import StepResult

if TYPE_CHECKING:
    from mpgraph.runtime.loop import TrainingLoop

__all__ = ["FinalCheckpointError", "StopRequest", "run_training", "stop_on_signals"]

logger = logging.getLogger(__name__)


class FinalCheckpointError(CheckpointError):
    """``run_training`` finished its steps but the checkpoint at the end was not written.

    The run itself is done: ``stop`` and ``seconds`` are what ``run_training`` would have
    returned, so a caller can still write its reports and summary before the error.
    """

    def __init__(self, message: str, stop: StopRequest, seconds: float) -> None:
        super().__init__(message)
        self.stop = stop
        self.seconds = seconds


class StopRequest:
    """Set by ``stop_on_signals`` when SIGINT/SIGTERM arrives; ``fit(stop=...)`` polls it
    between steps, so the step in flight finishes and the state stays consistent."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""


@contextmanager
def stop_on_signals(signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[StopRequest]:
    """Turn SIGINT/SIGTERM into a stop request for ``Trainer.fit`` while the block runs.

    The first signal only sets the request: the step in flight finishes, ``fit`` returns, and
    the caller can checkpoint a state whose step count and data position agree. A second
    signal raises ``KeyboardInterrupt`` at once (abandoning the step; nothing is written).
    Outside the main thread (where Python delivers no signals) the request never fires.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, frame: Any) -> None:
        if request.signal is not None:
            raise KeyboardInterrupt
        request.signal = signum
        logger.info("%s: finishing the step in flight, then stopping", signal.Signals(signum).name)

    previous = {}
    for sig in signals:
        previous[sig] = signal.signal(sig, handler)
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_training(
    trainer: TrainingLoop,
    data: Dataset | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]],
    steps: int,
    lr: float | None = None,
    *,
    batch_size: int | None = None,
    seed: int | None = None,
    on_nonfinite: str = "stop",
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    callback: Callable[[int, StepResult], None] | None = None,
    on_checkpoint_error: Callable[[CheckpointError], None] | None = None,
    what: str = "the step graph",
) -> tuple[StopRequest, float]:
    """``trainer.fit`` as a run that never loses its work.

    Rules:
        1. SIGINT and SIGTERM finish the step in flight and end the run (the request says
           which signal); a second signal stops at once, without writing anything.
        2. With ``checkpoint``, the state is checkpointed every ``checkpoint_every`` steps,
           when a non-finite step stops the run, and at the end.
        3. A periodic checkpoint that cannot be written (a full disk) does not stop the run:
           the first failure goes to ``on_checkpoint_error``, later ones are counted and told
           once when the steps end (a run checkpointing every step once printed 1,200 lines).
        4. An ONNX Runtime failure becomes one line naming the step and the node.

    Args:
        trainer: The trainer to run.
        data: What ``fit`` takes: a ``Dataset``, arrays by input name, or ready batches.
        steps: Steps to run now.
        lr: Learning rate (``None``: the one in use).
        batch_size: Samples per batch (``None``: ``fit``'s default).
        seed: Shuffle seed (``None``: ``fit``'s default).
        on_nonfinite: ``fit``'s ``on_nonfinite``.
        checkpoint: Where to checkpoint (``None``: nowhere).
        checkpoint_every: Also checkpoint every N steps (0: only at the end).
        callback: Called after every step with the step number and its result.
        on_checkpoint_error: Told of the first periodic checkpoint that could not be
            written, and of how many more were not (``None``: logged warnings).
        what: The graph's name in error messages (e.g. its path).

    Returns:
        The stop request (true when a signal ended the run) and the seconds the steps took
        (periodic checkpoints included, the one at the end not).

    Raises:
        TrainingError: A non-finite batch or loss with ``on_nonfinite="stop"`` (the message
            says which checkpoint was written).
        FinalCheckpointError: The steps ran but the checkpoint at the end cannot be written
            (it carries the stop request and the seconds).
        CheckpointError: The checkpoint of a run stopped by a non-finite step cannot be written.
        MpgraphError: A second signal, or an ONNX Runtime failure.
    """
    unwritten: list[int] = []  # steps whose periodic checkpoint failed

    def tell(e: CheckpointError) -> None:
        if on_checkpoint_error is None:
            logger.warning("%s", e)
        else:
            on_checkpoint_error(e)

    def on_step(n: int, result: StepResult) -> None:
        if callback is not None:
            callback(n, result)
        if checkpoint is not None and checkpoint_every and n % checkpoint_every == 0:
            try:
                trainer.save_checkpoint(checkpoint)
            except CheckpointError as e:  # a full disk: keep training, keep the last good one
                unwritten.append(n)
                if len(unwritten) == 1:
                    tell(CheckpointError(f"{e}; training goes on (later failures are counted, not repeated)"))

    began = time.perf_counter()
    try:
        with stop_on_signals() as stop:
            try:
                trainer.fit(data, steps, lr, batch_size=batch_size, seed=seed, callback=on_step,
                            on_nonfinite=on_nonfinite, stop=stop)
            finally:
                if len(unwritten) > 1:
                    last = trainer.last_checkpoint_step
                    tell(CheckpointError(
                        f"{len(unwritten)} periodic checkpoints were not written (steps {unwritten[0]} to "
                        f"{unwritten[-1]}); " + (f"the last good checkpoint holds step {last}" if last is not None
                                                 else "no checkpoint of this run was written")))
    except KeyboardInterrupt:
        last = trainer.last_checkpoint_step
        raise MpgraphError(
            "interrupted again: stopped at once without writing a checkpoint"
            + (f"; the last checkpoint ({checkpoint}, step {last}) is kept" if last is not None else "")
        ) from None
    except TrainingError as e:
        if checkpoint is None:
            raise
        trainer.save_checkpoint(checkpoint)
        raise TrainingError(f"{e}; wrote checkpoint {checkpoint} (step {trainer.steps})") from e
    except MpgraphError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT raises RuntimeError and its own pybind types
        error = providers.ort_error(e, f"running step {trainer.steps + 1} of {what}")
        if error is None:
            raise
        raise error from e
    seconds = time.perf_counter() - began
    if checkpoint is not None:
        try:
            trainer.save_checkpoint(checkpoint)
        except CheckpointError as e:
            raise FinalCheckpointError(str(e), stop, seconds) from e
    return stop, seconds
