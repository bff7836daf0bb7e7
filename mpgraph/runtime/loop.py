"""The training loop: steps, ``fit`` and what a bad step does, over an ``Executor``.

``TrainingLoop`` counts the steps and records the metrics; the executor runs them. Steps are
launched and then settled: on a pipelined executor step k+1 is launched before step k is read,
and a step whose loss is not finite is undone with the one launched after it (their state sets
are intact), which then runs again, so the outcome is that of running them one at a time. The
data stream and checkpoints are ``stream.DataStream``'s, which this class extends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from mpgraph.data import Batches, Dataset
from mpgraph.errors import MpgraphError, TrainingError, UsageError
from mpgraph.runtime.metrics import StepResult
from mpgraph.runtime.replay import Launched
from mpgraph.runtime.stream import DataStream

if TYPE_CHECKING:
    from mpgraph.runtime.metrics import Metrics

__all__ = ["COLLAPSE_SKIPS", "NONFINITE_MODES", "TrainingLoop"]

logger = logging.getLogger(__name__)

#: ``fit(on_nonfinite=...)``: what a non-finite batch or loss does.
NONFINITE_MODES = ("stop", "skip", "ignore")
#: Consecutive skipped steps after which the loss scale counts as collapsed (a warning).
COLLAPSE_SKIPS = 20


def _nonfinite_arrays(batch: Mapping[str, np.ndarray]) -> str | None:
    """``"N non-finite values in 'x'"`` for the first float array with NaN/inf, else ``None``."""
    for name, a in batch.items():
        a = np.asarray(a)
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            return f"{int((~np.isfinite(a)).sum())} non-finite value(s) (NaN or inf) in '{name}'"
    return None


class _FitReport:
    """What ``fit`` does with each finished step's result, in order: the collapse warning,
    the callback and the progress log."""

    def __init__(self, trainer: TrainingLoop, steps: int, callback: Callable[[int, StepResult], None] | None,
                 progress: bool) -> None:
        self.trainer, self.steps, self.callback, self.progress = trainer, steps, callback, progress
        self.every = max(steps // 10, 1)
        self.done = self.run_skips = 0
        self.warned = False

    def __call__(self, result: StepResult) -> None:
        trainer = self.trainer
        step = trainer.metrics.step[-1]  # the result's own record: appended just before
        self.done += 1
        self.run_skips = self.run_skips + 1 if result.skipped else 0
        if self.run_skips >= COLLAPSE_SKIPS and not self.warned:
            self.warned = True
            scale = f" (loss scale now {trainer.loss_scale:g})" if trainer.has_loss_scale else ""
            logger.warning(
                "loss scale collapsed: %d consecutive steps skipped for non-finite gradients, up to step %d%s; "
                "check the data and the model for inf/NaN, or train in bfloat16", self.run_skips, step, scale)
        if self.callback is not None:
            self.callback(step, result)
        if self.progress and (self.done % self.every == 0 or self.done == self.steps):
            logger.info("step %d: loss %.5g%s%s", step, result.loss,
                        f", scale {result.loss_scale:g}" if result.loss_scale is not None else "",
                        ", skipped" if result.skipped else "")


class TrainingLoop(DataStream):
    """``step``, ``step_many`` and ``fit`` over ``self.executor`` (set by the subclass)."""

    track_scale: bool

    def _start_loop(self) -> None:
        """The loop's own state, once the subclass has set ``options``, ``program`` and
        ``executor``."""
        self.track_scale = self.options.track_scale
        self.has_loss_scale = self.program.scale_name is not None
        self.stop_reason = ""
        self._init_loop_state()

    def _check_inputs(self, batch: Mapping[str, np.ndarray]) -> None:
        for spec in self.program.data_inputs:
            if spec.name not in batch:
                raise MpgraphError(f"batch has no array for input '{spec.name}' (got {', '.join(batch)})")

    def step(self, batch: Mapping[str, np.ndarray], lr: float | None = None) -> StepResult:
        """Run one training step on ``batch`` (data input name -> array).

        Args:
            batch: Arrays for every data input (``x``, ``label``, ...).
            lr: Learning rate (``None``: the one in use, i.e. a resumed checkpoint's, else the
                graph's default).
        """
        self.executor.bind_lr(lr)
        self._check_inputs(batch)
        return self._finish(self._launch(batch))

    def step_many(self, batches: Iterable[Mapping[str, np.ndarray]], lr: float | None = None) -> list[StepResult]:
        """Run one step per batch, in order; the same results (and state) as ``step`` on each.

        On a pipelined trainer (``pipeline``) the host enqueues step k+1 before it reads step
        k's loss, so the GPU never waits for the host between steps (the tiny MLP on an H200:
        134 us a step against ``step``'s 228, ``benchmarks/results/pipeline_probe_trainer.txt``).
        A non-finite loss is trained on, as ``step`` does (``fit`` undoes it).
        """
        batches = list(batches)
        self.executor.bind_lr(lr)
        for batch in batches:
            self._check_inputs(batch)
        results: list[StepResult] = []
        try:
            for batch in batches:
                self._settle(self._launch(batch), "ignore", results.append)
            self._settle(None, "ignore", results.append)
        except BaseException:
            self._abandon("ignore")
            raise
        return results

    def _launch(self, batch: Mapping[str, np.ndarray], position: tuple[int, int] | None = None) -> Launched:
        """Run (or enqueue) one step on ``batch`` and count it; ``_finish`` reads its result."""
        start = time.perf_counter()
        launched = self.executor.launch(batch)
        self.steps += 1
        launched.start, launched.step, launched.position = start, self.steps, position
        return launched

    def _advance(self, steps: int) -> None:
        """Undo ``-steps`` launched steps whose state sets are intact."""
        self.executor.rewind(steps)
        self.steps += steps
        self.metrics.truncate(self.steps)

    def _finish(self, launched: Launched) -> StepResult:
        """Wait for a launched step (its own event only) and record its result."""
        loss, skipped = self.executor.read(launched)
        # The set it read is intact: the step after it (if launched) writes another one.
        scale = self.executor.scale_in(launched.slot) if self.has_loss_scale and self.track_scale else None
        result = StepResult(loss, scale, skipped, time.perf_counter() - launched.start)
        self.metrics.append(launched.step, result)
        return result

    def _settle(self, launched: Launched | None, mode: str, report: Callable[[StepResult], None]) -> None:
        """Add ``launched`` to the steps in flight, then finish and report every one but the
        newest (pipelined) or all of them (otherwise, or ``launched=None``: drain).

        A finished step whose loss is not finite and was not skipped by the graph is undone
        unless ``mode`` is ``ignore``, with the step launched after it, which is then run
        again from the restored state: the same outcome as without pipelining.
        """
        if launched is not None:
            self._inflight.append(launched)
        keep = 1 if self.executor.pipeline and launched is not None else 0
        while len(self._inflight) > keep:
            result = self._finish(self._inflight[0])
            self._inflight.pop(0)
            if not self._undoes(result, mode):
                report(result)
                continue
            if self._in_place:
                raise TrainingError(
                    f"non-finite training at step {self.steps - len(self._inflight)}: the loss is {result.loss}, and the "
                    "state was updated in place (inplace_state), so it holds that step's update and cannot be "
                    "undone; pass inplace_state=False to keep the state before each step (a second copy of it)")
            after, self._inflight = self._inflight, []
            self.executor.wait(after)  # they read the bad step's state: they go too
            self._advance(-1 - len(after))
            report(self._refuse(f"step {self.steps + 1}: the loss is {result.loss} (the update was undone)", mode))
            for step in after:
                self._settle(self._launch(step.batch, step.position), mode, report)

    def _abandon(self, mode: str) -> None:
        """After an exception: finish the steps in flight, keeping those that ended well."""
        while self._inflight:
            result = self._finish(self._inflight[0])
            self._inflight.pop(0)
            if self._undoes(result, mode) and not self._in_place:  # in place: nothing to go back to
                self.executor.wait(self._inflight)
                self._advance(-1 - len(self._inflight))
                self._inflight = []

    @property
    def _in_place(self) -> bool:
        """Some state is updated in place (``Executor.inplace``; a data-parallel executor has
        none), so a step cannot be undone."""
        return bool(getattr(self.executor, "inplace", ()))

    @staticmethod
    def _undoes(result: StepResult, mode: str) -> bool:
        """``fit`` undoes this finished step: its loss is not finite, the graph did not skip it,
        and ``on_nonfinite`` is not ``ignore``."""
        return mode != "ignore" and not result.skipped and not math.isfinite(result.loss)

    def fit(
        self,
        data: Dataset | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]],
        steps: int,
        lr: float | None = None,
        *,
        batch_size: int | None = None,
        seed: int | None = None,
        progress: bool = False,
        callback: Callable[[int, StepResult], None] | None = None,
        on_nonfinite: str = "stop",
        stop: Callable[[], bool] | None = None,
    ) -> Metrics:
        """Run ``steps`` steps and return all metrics so far (also ``self.metrics``).

        Rules:
            1. Every float array of a batch is checked before the step; a NaN or inf in it is
               reported with the step and the array (see ``on_nonfinite``).
            2. A non-finite loss that the graph did not skip itself (no loss scaling, or bf16)
               is caught after the step: the step is undone (the previous state buffers are
               still intact), then ``on_nonfinite`` decides.
            3. ``stop()`` is polled before every step: when it returns True the loop ends with
               a consistent state (``stop_reason`` says why), ready for ``save_checkpoint``.
            4. An exception inside a step (Ctrl-C without ``stop_on_signals``, an ORT error)
               puts the data stream back to the batch of that step, so a checkpoint written
               afterwards is not a batch ahead of its step count.
            5. ``COLLAPSE_SKIPS`` consecutive skipped steps log a warning once: the loss scale
               has collapsed.
            6. On a pipelined trainer (``pipeline``) step k+1 is launched before step k's
               result is read, so ``callback`` sees step k while step k+1 runs. Rules 2-4 hold
               as without pipelining: a bad step is undone with the step launched after it,
               which then runs again, and a checkpoint written from the callback holds step k.
            7. A trainer that updates the state in place (``inplace_state``) has no state to
               go back to: a non-finite loss it did not skip raises ``TrainingError`` whatever
               ``on_nonfinite`` says (the state then holds that step's update).

        Args:
            data: A ``Dataset`` (its train split) or arrays by input name: batched in a seeded
                order whose position checkpoints keep; or any iterable of ready batches.
            steps: Steps to run now.
            lr: Learning rate (``None``: the one in use, i.e. a resumed checkpoint's, else the
                graph's default).
            batch_size: Samples per batch (``None``: a resumed checkpoint's, else 64).
            seed: Shuffle seed (``None``: a resumed checkpoint's, else 0).
            progress: Log the loss at INFO level about every tenth of the run.
            callback: Called after every step with the step number and its result.
            on_nonfinite: ``stop`` (raise ``TrainingError`` naming the step; the state is
                that of the last good step), ``skip`` (the step counts but leaves the state as
                it was, recorded as skipped with a NaN loss) or ``ignore`` (train on it).
            stop: Polled before each step; True ends the run early.

        Raises:
            TrainingError: A non-finite batch or loss with ``on_nonfinite="stop"``.
            CheckpointError: After ``load_checkpoint``: another ``batch_size``, ``seed`` or
                dataset than the checkpoint's run (``stream_settings``, ``check_resumed_data``).
        """
        if steps < 0:
            raise UsageError(f"steps must be >= 0, got {steps}")
        if on_nonfinite not in NONFINITE_MODES:
            raise UsageError(f"on_nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {on_nonfinite!r}")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise UsageError(f"learning rate must be finite and >= 0, got {lr}")
        it: Iterator[Mapping[str, np.ndarray]]
        it = self._batches_for(data, batch_size, seed) if isinstance(data, (Dataset, Mapping)) else iter(data)
        self.stop_reason = ""
        self.executor.bind_lr(lr)
        report = _FitReport(self, steps, callback, progress)
        try:
            self._run(it, steps, on_nonfinite, report, stop)
        except BaseException:
            self._abandon(on_nonfinite)
            if self._marks is not None and self.steps in self._marks:
                it.seek(self._marks[self.steps])  # type: ignore[attr-defined]
            raise
        return self.metrics

    def _run(self, it: Iterator[Mapping[str, np.ndarray]], steps: int, mode: str,
             report: Callable[[StepResult], None], stop: Callable[[], bool] | None) -> None:
        """``fit``'s steps; ``_marks`` keeps the data position after each counted step's batch,
        so that an exception puts the stream back to the one after the last step that counts."""
        self._marks = {self.steps: it.position} if isinstance(it, Batches) else None
        for _ in range(steps):
            if stop is not None and stop():
                self.stop_reason = getattr(stop, "name", "") or "stop requested"
                break
            before = it.position if isinstance(it, Batches) else None
            try:
                batch = next(it)
            except StopIteration:
                break
            problem = None if mode == "ignore" else _nonfinite_arrays(batch)
            if problem is not None:
                self._settle(None, mode, report)  # the steps in flight come first
                if self._marks is not None:
                    self._marks[self.steps + 1] = it.position  # type: ignore[attr-defined]
                report(self._refuse(f"step {self.steps + 1}: the batch has {problem}", mode))
                continue
            self._check_inputs(batch)
            launched = self._launch(batch, before)
            if self._marks is not None:
                self._marks[self.steps] = it.position  # type: ignore[attr-defined]
            self._settle(launched, mode, report)
        self._settle(None, mode, report)

    def _refuse(self, what: str, mode: str) -> StepResult:
        """A non-finite batch or loss: raise (``stop``) or count a skipped step (``skip``)."""
        if mode == "stop":
            raise TrainingError(f"non-finite training at {what}; the state is that of step {self.steps} "
                                "(pass --on-nonfinite skip to skip such steps)")
        logger.warning("skipped %s", what)
        scale = self.loss_scale if self.has_loss_scale and self.track_scale else None
        self.steps += 1
        result = StepResult(math.nan, scale, True, 0.0)
        self.metrics.append(self.steps, result)
        return result
