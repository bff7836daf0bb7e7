"""Data-parallel training of a step graph over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Every rank holds the whole model and runs the same step on its share of the global batch:

1. **Gradients.** The step graph is cut by ``training.split_step_graph``; each rank runs the
   gradient part on its batch share (``micro_batches`` times on equal slices of it, for
   gradient accumulation). ORT writes every gradient, and the loss, straight into flat
   float32 **buckets** (IOBinding onto views of the bucket arrays, no copies). The layout is
   fixed by the graph: gradients in reverse ``mpgraph.gradients`` order (the order the
   backward finishes them), a new bucket after ``bucket_bytes``; the loss is the last
   element of the last bucket.
2. **Reduction.** ``reduction="ordered"`` (the default) fixes the order of the sum: per
   bucket an ``all_to_all`` gives rank r chunk r of every rank's bucket, rank r sums those N
   chunks as a fixed binary tree (``gradient_buckets.pairwise_sum``; a rank's micro-batches are summed the
   same way first), and an ``all_gather`` returns the summed chunks to every rank; then one
   division by the number of slices. These are the two halves of a ring all-reduce
   (reduce-scatter, all-gather), with the same traffic, 2 (N - 1) / N of a bucket a rank,
   and one bucket of receive buffer. N processes with B/N samples each then give exactly
   the bits of one process that sums the same N slices (``micro_batches=N``); with
   ``micro_batches`` a power of two, any world size with as many slices does (a run resumes
   on another world size bit for bit). ``reduction="all_reduce"`` (one ``all_reduce(SUM)``
   a bucket) sums in the backend's order: on 3 gloo ranks, other bits than a rank-order sum
   in 27 of the GPT's 32 state arrays after 2 steps; fixed for 2 ranks only (a + b = b + a).
3. **Apply.** The apply part runs on every rank on the reduced buckets (bound as views):
   loss scaling's finite check sees the same numbers on every rank, so every rank skips the
   same steps (an inf on one rank makes the reduced sum inf everywhere) and the scale
   sequence is one process's.
4. **Optimizer-state sharding** (``shard_optimizer=True``, ZeRO stage 1). A packed slot
   (many small parameters updated as one flat vector, the default AdamW's form for
   parameters under 65,536 elements; ``training.flat_slots``) is updated in N contiguous
   slices: each rank keeps its slice of the slot's moments, updates it
   (``training.shard_flat_slots``), and the slices of the new flat parameter are
   all-gathered and unpacked. The other state is split into groups that update
   independently (a parameter with its moments; ``training.optimizer_groups``), dealt to
   ranks by size; the owner updates a group and broadcasts its parameters, one flat buffer
   per owner. Scalars (step counter, loss scale) are updated on every rank. Each rank runs
   one apply part pruned and sliced to its share (``training.shard_apply_part``). Bit for
   bit the unsharded update: every element is computed by the same ops on the same numbers.
5. **Checkpoints** are collective: moments are gathered to rank 0, which writes one
   ``.npz`` atomically (``io.write_atomic``); every rank waits for it. Any world size can
   read it back (the state is whole), sharded or not.

Not overlapped with the backward: the gradient part is one ORT run, so the buckets are
reduced after it (all issued before the first wait). On CUDA the buckets are torch tensors on
the rank's GPU that ORT writes through DLPack and NCCL reduces in place
(``runtime.parallel_executor``); that path has not run on a GPU yet.

The executor is ``runtime.parallel_executor.DataParallelExecutor``: an ``Executor`` whose two
sessions (gradient part, apply part) come from ``Program.plan_part``, that is from
``lowering.plan_session``, so a data-parallel step is lowered as a one-process step is.
``DataParallelRunner`` is its face for a hand-written loop (``step`` on this rank's share,
collective ``save``/``load``), ``train_data_parallel`` the loop over a dataset.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from mpgraph.data import dataset_for_model
from mpgraph.errors import CheckpointError, OutputError, UsageError
from mpgraph.io import write_atomic
from mpgraph.runtime.metrics import StepResult
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.parallel_executor import DataParallelExecutor, DataParallelOptions, shard_batch
from mpgraph.runtime.parallel_trainer import DataParallelTrainer
from mpgraph.runtime.program import Program

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["DataParallelOptions", "DataParallelRunner", "DataParallelStep", "backend_for", "shard_batch",
           "train_data_parallel"]

logger = logging.getLogger(__name__)

FORMAT = "mpgraph.data_parallel/1"


@dataclasses.dataclass(frozen=True)
class DataParallelStep:
    """One step: the loss averaged over the global batch, and whether loss scaling skipped it."""

    loss: float
    skipped: bool


def backend_for(provider: str) -> str:
    """The ``torch.distributed`` backend for an ORT provider: NCCL for CUDA, else gloo."""
    return "nccl" if provider == "cuda" else "gloo"


class DataParallelRunner:
    """Runs a training step graph on every rank of a ``torch.distributed`` group (module rules).

    Every rank builds the runner from the same step graph, calls ``step`` with its own share of
    the global batch (``shard_batch``), and ``save``/``load`` together. Without a process group
    it runs alone (world size 1), which with ``micro_batches=N`` reproduces N ranks.

    Args:
        step: A step graph from ``build_training_graph`` with an optimizer, converted or not.
        options: Bucket size, reduction, micro-batches, optimizer sharding, threads.
        group: The process group (``None``: the default group, if one is initialized).
        run_options: How the sessions run and are lowered (``kernels``; ``None``: the CPU
            defaults with ``options.threads``).
    """

    def __init__(self, step: ir.Model, *, options: DataParallelOptions | None = None,
                 group: torch.distributed.ProcessGroup | None = None, run_options: RunOptions | None = None) -> None:
        self.options = options or DataParallelOptions()
        self.program = Program(step)
        self.executor = DataParallelExecutor(self.program, run_options or RunOptions(threads=self.options.threads),
                                             self.options, group)
        self.rank, self.world, self.split = self.executor.rank, self.executor.world, self.executor.split
        self.steps = 0

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Copies of the state this rank holds (all of it unless the optimizer is sharded)."""
        return {n: a.copy() for n, a in self.executor.held.items()}

    def step(self, feeds: Mapping[str, np.ndarray], *, lr: float | None = None) -> DataParallelStep:
        """One step on this rank's share of the global batch; every rank must call it."""
        self.executor.bind_lr(lr)
        loss, skipped = self.executor.run(feeds)
        self.steps += 1
        return DataParallelStep(loss, skipped)

    def full_state(self) -> dict[str, np.ndarray]:
        """Every state value, on every rank (collective: sharded moments are gathered)."""
        return self.executor.gather_state(everyone=True) or {}

    def save(self, path: str, extra: Mapping[str, object] | None = None) -> None:
        """Rule 5: rank 0 writes the whole state atomically; every rank calls it and waits.

        ``extra`` (JSON-serialisable, e.g. the data stream's position) is stored beside it.

        Raises:
            OutputError: On every rank, when rank 0 could not write (the previous file stays).
        """
        state = self.executor.gather_state(everyone=False)
        error = [""]
        if state is not None:
            meta = {"format": FORMAT, "steps": self.steps, "names": list(state), "world": self.world,
                    "extra": dict(extra or {})}
            buffer = io.BytesIO()
            np.savez(buffer, __meta__=np.array(json.dumps(meta)), **{f"s{i}": a for i, a in enumerate(state.values())})
            try:
                write_atomic(path, buffer.getvalue())
            except OutputError as e:
                error = [str(e)]
        self.executor.broadcast_object_list(error)
        if error[0]:
            raise OutputError(error[0])

    def load(self, path: str) -> dict[str, object]:
        """Every rank reads a checkpoint from ``save`` (any world size, sharded or not);
        returns the ``extra`` it was saved with.

        Raises:
            CheckpointError: Not such a checkpoint, or its state names or shapes differ.
        """
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["__meta__"]))
                arrays = {n: data[f"s{i}"] for i, n in enumerate(meta["names"])}
        except (OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: not a data-parallel checkpoint ({e})") from e
        if meta.get("format") != FORMAT or list(arrays) != [a for a, _ in self.split.state_pairs]:
            raise CheckpointError(f"{path}: its state ({meta.get('format')}, {len(arrays)} arrays) is not this "
                                  f"step graph's ({len(self.split.state_pairs)}); resume with the graph it was saved from")
        for name, array in arrays.items():
            if array.shape != self.program.initial[name].shape:
                raise CheckpointError(f"{path}: state '{name}' has shape {array.shape}, the graph another")
        self.executor.set_state(arrays)
        self.steps = int(meta["steps"])
        return dict(meta.get("extra", {}))


def train_data_parallel(step: ir.Model, data: str, *, steps: int, batch_size: int, seed: int = 0,
                        lr: float | None = None, checkpoint: str | None = None, checkpoint_every: int = 0,
                        resume: str | None = None, options: DataParallelOptions | None = None,
                        report: Callable[[int, StepResult], None] | None = None,
                        on_nonfinite: str = "stop", run_options: RunOptions | None = None) -> DataParallelTrainer:
    """Train on every rank of the process group (the Python twin of ``mpgraph train --nproc``).

    The one-process training loop (``DataParallelTrainer.fit``): every rank draws the same
    global batches of ``batch_size`` samples (``data.Batches``, seeded) and steps on its slice
    of each. Checkpoints (``checkpoint_every`` steps and at the end; collective, rank 0
    writes the one-process format) hold the data stream's position, so ``resume`` continues
    the stream, on any world size that divides the batch, or in a one-process ``Trainer``.

    Args:
        step: The step graph (the same on every rank).
        data: A dataset name (``digits``, ``sequence``) or ``.npz`` path (``data.dataset_for_model``).
        steps: Steps to run (after the resumed ones).
        batch_size: Global batch: divisible by world size times ``micro_batches``.
        report: Called on every rank with the step number and its result.
        on_nonfinite: ``fit``'s: a NaN/inf in a batch or an unskipped non-finite loss stops
            (``TrainingError``; the state is the last good step's), is skipped, or is ignored.
        run_options: How the sessions run (``provider="cuda"``: NCCL ranks, one GPU each;
            ``None``: the CPU with ``options.threads``).
    """
    options = options or DataParallelOptions()
    trainer = DataParallelTrainer(step, run_options or RunOptions(threads=options.threads), options)
    slices = trainer.world * options.micro_batches
    if batch_size % slices:
        raise UsageError(f"batch {batch_size} must be divisible by {trainer.world} ranks x "
                         f"{options.micro_batches} micro-batches = {slices}")
    dataset = dataset_for_model(data, trainer.program.data_inputs, seed=seed)
    if resume is not None:
        trainer.load_checkpoint(resume)

    def callback(done: int, result: StepResult) -> None:
        if report is not None:
            report(done, result)
        if checkpoint is not None and checkpoint_every and done % checkpoint_every == 0:
            trainer.save_checkpoint(checkpoint)

    trainer.fit(dataset, steps, lr, batch_size=batch_size, seed=seed, callback=callback, on_nonfinite=on_nonfinite)
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    return trainer
