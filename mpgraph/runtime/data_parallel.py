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
reduced after it (all issued before the first wait). On CUDA the buckets would be device
arrays handed to NCCL through DLPack; only the CPU path is written and tested here.

As an ``Executor`` (``runtime.executor``'s interface): ``ring`` 2 (``_state`` and ``_spare``
swap), ``launch`` = ``step`` (synchronous) and ``read`` its loss and skip flag, ``rewind(1)``
swaps back (the previous set is intact); it needs from ``Program`` a session plan per part
(the split, then lowering on each part), from the ``Executor`` base IOBinding of outputs onto
caller-owned buffers (bucket views) and a hook between two runs, and from the loop a
collective checkpoint (every rank calls ``save``; rank 0 writes) and ``full_state`` for the
sharded state.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from mpgraph._ir import meta as md
from mpgraph.data import Batches, InputSpec, dataset_for_model
from mpgraph.errors import CheckpointError, OutputError, UsageError
from mpgraph.io import write_atomic
from mpgraph.runtime.gradient_buckets import make_buckets, pairwise_sum
from mpgraph.training.shard_flat_slot import FlatSlot, flat_slots, slice_range
from mpgraph.training.split_step_graph import (
    SplitStep,
    deal_groups,
    optimizer_groups,
    shard_apply_part,
    split_step_graph,
)

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["DataParallelOptions", "DataParallelRunner", "DataParallelStep", "backend_for", "shard_batch",
           "train_data_parallel"]

logger = logging.getLogger(__name__)

FORMAT = "mpgraph.data_parallel/1"


@dataclasses.dataclass(frozen=True)
class DataParallelOptions:
    """How a ``DataParallelRunner`` reduces and updates.

    Attributes:
        bucket_bytes: Bytes of gradients per bucket (one collective each; torch DDP's 25 MiB).
        reduction: ``ordered`` (all_to_all, a fixed summation tree, all_gather: fixed float32 bits) or
            ``all_reduce`` (one sum collective: less traffic, order-dependent bits beyond 2 ranks).
        micro_batches: Slices of each rank's batch run one after the other and summed (a
            power of two keeps the bits independent of the world size, rule 2).
        shard_optimizer: ZeRO stage 1: each rank keeps and updates only its optimizer groups.
        threads: ORT intra-op threads (``None``: ORT's default).
    """

    bucket_bytes: int = 25 * 2**20
    reduction: str = "ordered"
    micro_batches: int = 1
    shard_optimizer: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.reduction not in ("ordered", "all_reduce"):
            raise UsageError(f"reduction must be 'ordered' or 'all_reduce', got '{self.reduction}'")
        if self.micro_batches < 1 or self.bucket_bytes < 4:
            raise UsageError("micro_batches must be >= 1 and bucket_bytes >= 4")


@dataclasses.dataclass(frozen=True)
class DataParallelStep:
    """One step: the loss averaged over the global batch, and whether loss scaling skipped it."""

    loss: float
    skipped: bool


def backend_for(provider: str) -> str:
    """The ``torch.distributed`` backend for an ORT provider: NCCL for CUDA, else gloo."""
    return "nccl" if provider == "cuda" else "gloo"


def shard_batch(feeds: Mapping[str, np.ndarray], index: int, count: int) -> dict[str, np.ndarray]:
    """Slice ``index`` of ``count`` equal, contiguous slices of a batch along its first axis.

    Example:
        >>> shard_batch({"x": np.arange(6)}, 1, 3)
        {'x': array([2, 3])}
    """
    out = {}
    for name, value in feeds.items():
        if len(value) % count:
            raise UsageError(f"batch input '{name}' has {len(value)} rows, not divisible into {count} slices")
        size = len(value) // count
        out[name] = value[index * size:(index + 1) * size]
    return out


class DataParallelRunner:
    """Runs a training step graph on every rank of a ``torch.distributed`` group (module rules).

    Every rank builds the runner from the same step graph, calls ``step`` with its own share of
    the global batch (``shard_batch``), and ``save``/``load`` together. Without a process group
    it runs alone (world size 1), which with ``micro_batches=N`` reproduces N ranks.

    Args:
        step: A step graph from ``build_training_graph`` with an optimizer, converted or not.
        options: Bucket size, reduction, micro-batches, optimizer sharding, threads.
        group: The process group (``None``: the default group, if one is initialized).
    """

    def __init__(self, step: ir.Model, *, options: DataParallelOptions | None = None,
                 group: torch.distributed.ProcessGroup | None = None) -> None:
        self._torch, self._dist = _torch()
        self.options = options or DataParallelOptions()
        self.group = group
        grouped = self._dist.is_available() and self._dist.is_initialized()
        self.rank = self._dist.get_rank(group) if grouped else 0
        self.world = self._dist.get_world_size(group) if grouped else 1
        self.split = split_step_graph(step)
        self.steps = 0
        initial = _initial_state(step, self.split)
        self.params = tuple(p for p, _ in self.split.gradients)
        shard = self.options.shard_optimizer
        self.slots = flat_slots(self.split.apply, list(self.split.state_pairs), set(self.params)) if shard else []
        self._slot_of = {n: slot for slot in self.slots for n in slot.state}
        self.owners = self._deal_groups(initial) if shard else {}
        held = [n for n, _ in self.split.state_pairs if self._holds(n)]
        self._state = {n: np.array(self._share(n, initial[n]), np.float32, copy=True) for n in held}
        self._spare = {n: np.empty_like(a) for n, a in self._state.items()}
        self._bindings: dict[tuple[object, ...], tuple[ort.IOBinding, list[ort.OrtValue]]] = {}
        self._outputs = dict(self.split.state_pairs)
        apply_model = self.split.apply if not shard else shard_apply_part(
            self.split, {self._outputs[n] for n in held}, self.slots, self.rank, self.world)
        self._grad_session = _session(self.split.gradient, self.options.threads)
        self._apply_session = _session(apply_model, self.options.threads)
        self._lr = float(initial.get("lr", np.float32(0.0)))
        shapes = {g: self._state[p].shape for p, g in self.split.gradients}
        self.buckets = make_buckets(self.split, shapes, self.options.bucket_bytes, self.world)
        # Slices in flight in the pairwise sum: one per level of the stack, and the one running.
        sets = int(np.ceil(np.log2(self.options.micro_batches))) + 2 if self.options.micro_batches > 1 else 0
        self._scratch = [[np.empty_like(b.array) for b in self.buckets] for _ in range(sets)]
        self._received = ([self._torch.empty(len(b.array)) for b in self.buckets]
                          if self.world > 1 and self.options.reduction == "ordered" else [])

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Copies of the state this rank holds (all of it unless the optimizer is sharded)."""
        return {n: a.copy() for n, a in self._state.items()}

    def step(self, feeds: Mapping[str, np.ndarray], *, lr: float | None = None) -> DataParallelStep:
        """One step on this rank's share of the global batch; every rank must call it."""
        passthrough = self._gradients(feeds)
        self._reduce()
        skipped, outputs = self._apply(passthrough, self._lr if lr is None else lr)
        for slot in self.slots:
            self._unpack(slot, self._all_gather_flat(outputs[slot.output].numpy(), slot.size))
        if self.options.shard_optimizer and self.world > 1:
            self._broadcast_params()
        self.steps += 1
        last = self.buckets[-1]
        return DataParallelStep(float(last.views()[self.split.loss]), skipped)

    def _gradients(self, feeds: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        """Rule 1: the gradient part over the micro-batches, summed pairwise into the buckets."""
        count = self.options.micro_batches
        if count == 1:
            return self._run_gradient(feeds, [b.array for b in self.buckets])
        pool = list(self._scratch)
        passthrough: dict[str, ort.OrtValue] = {}

        def slices() -> Iterator[list[np.ndarray]]:
            nonlocal passthrough
            for k in range(count):
                arrays = pool.pop()
                passthrough = self._run_gradient(shard_batch(feeds, k, count), arrays)
                yield arrays

        total = pairwise_sum(slices(), pool.append)
        for bucket, array in zip(self.buckets, total, strict=True):
            np.copyto(bucket.array, array)
        pool.append(total)
        return passthrough

    def _run_gradient(self, feeds: Mapping[str, np.ndarray], arrays: list[np.ndarray]) -> dict[str, ort.OrtValue]:
        """The gradient part on one slice, its gradients and loss written into ``arrays``
        (one per bucket); returns the passthrough values. Only the batch is bound anew."""
        key = ("gradient", id(self._state), id(arrays[0]))
        if key not in self._bindings:
            views = {n: v for b, a in zip(self.buckets, arrays, strict=True) for n, v in b.views(a).items()}
            self._bindings[key] = self._binding(self._grad_session, {}, views)
        binding, _ = self._bindings[key]
        keep = _bind_inputs(binding, feeds)
        self._grad_session.run_with_iobinding(binding)
        del keep
        if not self.split.passthrough:
            return {}
        made = dict(zip([o.name for o in self._grad_session.get_outputs()], binding.get_outputs(), strict=True))
        return {n: made[n] for n in self.split.passthrough}

    def _binding(self, session: ort.InferenceSession, extra: Mapping[str, np.ndarray],
                 outputs: Mapping[str, np.ndarray]) -> tuple[ort.IOBinding, list[ort.OrtValue]]:
        """A binding that reads the current state set (and ``extra``) and writes each output
        named in ``outputs`` into its array, the others to new CPU buffers, in session order
        (so ``get_outputs`` lines up). Made once per state set and buffer set: the arrays are
        only ever written in place."""
        wanted = _input_names(session)
        binding = session.io_binding()
        keep = _bind_inputs(binding, {n: a for n, a in {**self._state, **extra}.items() if n in wanted})
        for name in (o.name for o in session.get_outputs()):
            if name in outputs:
                keep.append(ort.OrtValue.ortvalue_from_numpy(outputs[name]))
                binding.bind_ortvalue_output(name, keep[-1])
            else:  # found_inf, passthrough values, a packed slot's slice of the new parameter
                binding.bind_output(name, "cpu")
        return binding, keep

    def _reduce(self) -> None:
        """Rule 2: the buckets reduced across ranks (every collective issued before the first
        wait), then the mean over slices."""
        torch, dist = self._torch, self._dist
        slices = np.float32(self.world * self.options.micro_batches)
        if self.world > 1 and self.options.reduction == "ordered":
            self._reduce_ordered()
        elif self.world > 1:
            works = [dist.all_reduce(torch.from_numpy(b.array), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                     for b in self.buckets]
            for work in works:
                work.wait()
        if slices != 1:
            for b in self.buckets:
                np.divide(b.array, slices, out=b.array)

    def _reduce_ordered(self) -> None:
        """Rule 2, ordered: per bucket an ``all_to_all`` (rank r receives chunk r of every
        rank's bucket), the fixed-tree sum of those chunks, and an ``all_gather`` of the
        summed chunks back into every rank's bucket."""
        torch, dist = self._torch, self._dist
        scatters = [dist.all_to_all_single(received, torch.from_numpy(b.array), group=self.group, async_op=True)
                    for b, received in zip(self.buckets, self._received, strict=True)]
        gathers = []
        for bucket, received, work in zip(self.buckets, self._received, scatters, strict=True):
            work.wait()
            chunks = received.numpy().reshape(self.world, -1)
            (total,) = pairwise_sum(([chunk] for chunk in chunks), lambda _: None)
            into = list(torch.from_numpy(bucket.array).view(self.world, -1).unbind(0))
            gathers.append(dist.all_gather(into, torch.from_numpy(total), group=self.group, async_op=True))
        for work in gathers:
            work.wait()

    def _apply(self, passthrough: Mapping[str, ort.OrtValue], lr: float) -> tuple[bool, dict[str, ort.OrtValue]]:
        """Rule 3: the apply part on the reduced buckets; returns whether the step was skipped,
        and the outputs not bound to state buffers."""
        session = self._apply_session
        key = ("apply", id(self._state))
        if key not in self._bindings:
            views = {n: v for b in self.buckets for n, v in b.views().items()}
            self._bindings[key] = self._binding(session, views, {self._outputs[n]: a for n, a in self._spare.items()})
        binding, _ = self._bindings[key]
        wanted = _input_names(session)
        keep = _bind_inputs(binding, {"lr": np.asarray(lr, dtype=np.float32)} if "lr" in wanted else {})
        for name, value in passthrough.items():
            if name in wanted:
                binding.bind_ortvalue_input(name, value)
        session.run_with_iobinding(binding)
        del keep
        outputs = dict(zip([o.name for o in session.get_outputs()], binding.get_outputs(), strict=True))
        self._state, self._spare = self._spare, self._state
        return (bool(outputs[md.FOUND_INF].numpy()) if md.FOUND_INF in outputs else False), outputs

    def _deal_groups(self, initial: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Rule 4: the owner of every grouped state input (``training.deal_groups``)."""
        groups = [g for g in optimizer_groups(self.split)[0] if not any(n in self._slot_of for n in g)]
        if not self.slots and len(groups) < self.world:
            logger.warning("optimizer sharding: %d update group(s) for %d ranks, so some ranks hold no optimizer "
                           "state; a packed optimizer updates small parameters as one group (build the step "
                           "graph with optimizer_options={'pack': False})", len(groups), self.world)
        owners = deal_groups([sum(int(initial[n].size) for n in g) for g in groups], self.world)
        return {n: owner for g, owner in zip(groups, owners, strict=True) for n in g}

    def _holds(self, name: str) -> bool:
        """Every rank holds the parameters (the forward reads them), the scalar state, and its
        slice of each packed slot's state."""
        return name in self.params or name in self._slot_of or self.owners.get(name, self.rank) == self.rank

    def _share(self, name: str, array: np.ndarray) -> np.ndarray:
        """This rank's slice of a packed slot's state; other state whole."""
        slot = self._slot_of.get(name)
        if slot is None:
            return array
        start, end = slice_range(slot.size, self.rank, self.world)
        return array[start:end]

    def _all_gather_flat(self, part: np.ndarray, size: int) -> np.ndarray:
        """Every rank's slice of a ``size``-element vector, in rank order (padded to one
        length for the collective)."""
        torch, dist = self._torch, self._dist
        if self.world == 1:
            return part
        ranges = [slice_range(size, r, self.world) for r in range(self.world)]
        width = max(b - a for a, b in ranges)
        padded = np.zeros(width, np.float32)
        padded[:part.size] = part
        gathered = [torch.empty(width) for _ in range(self.world)]
        dist.all_gather(gathered, torch.from_numpy(padded), group=self.group)
        return np.concatenate([t.numpy()[:b - a] for t, (a, b) in zip(gathered, ranges, strict=True)])

    def _unpack(self, slot: FlatSlot, flat: np.ndarray) -> None:
        """The new flat parameter of a packed slot into its parameters' state buffers."""
        start = 0
        for name, size in slot.members:
            self._state[name][...] = flat[start:start + size].reshape(self._state[name].shape)
            start += size

    def _broadcast_params(self) -> None:
        """Rule 4: each owner's updated parameters, one flat broadcast per owner."""
        torch, dist = self._torch, self._dist
        for owner in range(self.world):
            names = [p for p in self.params if self.owners.get(p) == owner]
            if not names:
                continue
            if owner == self.rank:
                flat = np.concatenate([self._state[p].ravel() for p in names])
            else:
                flat = np.empty(sum(self._state[p].size for p in names), np.float32)
            source = owner if self.group is None else dist.get_global_rank(self.group, owner)
            dist.broadcast(torch.from_numpy(flat), src=source, group=self.group)
            if owner != self.rank:
                start = 0
                for p in names:
                    size = self._state[p].size
                    self._state[p][...] = flat[start:start + size].reshape(self._state[p].shape)
                    start += size

    def full_state(self) -> dict[str, np.ndarray]:
        """Every state value, on every rank (collective: sharded moments are gathered)."""
        return self._gather_state(everyone=True) or {}

    def _gather_state(self, *, everyone: bool) -> dict[str, np.ndarray] | None:
        """The whole state in ``state_pairs`` order on rank 0 (or every rank); ``None`` elsewhere."""
        dist = self._dist
        held = {n: a.copy() for n, a in self._state.items()}
        if self.options.shard_optimizer and self.world > 1:
            mine = {n: a for n, a in held.items()
                    if n not in self.params and (self.owners.get(n) == self.rank or n in self._slot_of)}
            parts: list[dict[str, np.ndarray]] = [{} for _ in range(self.world)]
            if everyone:
                dist.all_gather_object(parts, mine, group=self.group)
            else:
                dist.gather_object(mine, parts if self.rank == 0 else None, dst=0, group=self.group)
            if everyone or self.rank == 0:
                for part in parts:
                    held.update(part)
                held.update({n: np.concatenate([part[n] for part in parts]) for n in self._slot_of})
        if not everyone and self.rank != 0:
            return None
        return {a: held[a] for a, _ in self.split.state_pairs}

    def save(self, path: str, extra: Mapping[str, object] | None = None) -> None:
        """Rule 5: rank 0 writes the whole state atomically; every rank calls it and waits.

        ``extra`` (JSON-serialisable, e.g. the data stream's position) is stored beside it.

        Raises:
            OutputError: On every rank, when rank 0 could not write (the previous file stays).
        """
        dist = self._dist
        state = self._gather_state(everyone=False)
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
        if self.world > 1:
            dist.broadcast_object_list(error, src=0, group=self.group)
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
        for name, array in self._state.items():
            share = self._share(name, arrays[name])
            if share.shape != array.shape:
                raise CheckpointError(f"{path}: state '{name}' has shape {arrays[name].shape}, the graph another")
            array[...] = share
        self.steps = int(meta["steps"])
        return dict(meta.get("extra", {}))


def train_data_parallel(step: ir.Model, data: str, *, steps: int, batch_size: int, seed: int = 0,
                        lr: float | None = None, checkpoint: str | None = None, checkpoint_every: int = 0,
                        resume: str | None = None, options: DataParallelOptions | None = None,
                        report: Callable[[int, DataParallelStep], None] | None = None) -> DataParallelRunner:
    """Train on every rank of the process group (the Python twin of ``mpgraph train --nproc``).

    Every rank draws the same global batches of ``batch_size`` samples (``data.Batches``,
    seeded) and steps on its slice of each. Checkpoints (``checkpoint_every`` steps and at
    the end) hold the data stream's position, so ``resume`` continues the stream, on any
    world size that divides the batch.

    Args:
        step: The step graph (the same on every rank).
        data: A dataset name (``digits``, ``sequence``) or ``.npz`` path (``data.dataset_for_model``).
        steps: Steps to run (after the resumed ones).
        batch_size: Global batch: divisible by world size times ``micro_batches``.
        report: Called on every rank with the step number and its result.
    """
    runner = DataParallelRunner(step, options=options)
    slices = runner.world * runner.options.micro_batches
    if batch_size % slices:
        raise UsageError(f"batch {batch_size} must be divisible by {runner.world} ranks x "
                         f"{runner.options.micro_batches} micro-batches = {slices}")
    graph = runner.split.gradient.graph
    specs = [InputSpec(v.name or "", np.dtype(v.dtype.numpy()) if v.dtype is not None else np.dtype(np.float32),
                       None if v.shape is None else tuple(d if isinstance(d, int) else str(d) for d in v.shape))
             for v in graph.inputs if v.name in runner.split.data_inputs]
    stream = Batches(dataset_for_model(data, specs, seed=seed).train, batch_size=batch_size, seed=seed)
    if resume is not None:
        position = runner.load(resume).get("data")
        if isinstance(position, list):
            stream.seek((int(position[0]), int(position[1])))
    for _ in range(steps):
        result = runner.step(shard_batch(next(stream), runner.rank, runner.world), lr=lr)
        if report is not None:
            report(runner.steps, result)
        if checkpoint is not None and checkpoint_every and runner.steps % checkpoint_every == 0:
            runner.save(checkpoint, {"data": list(stream.position)})
    if checkpoint is not None:
        runner.save(checkpoint, {"data": list(stream.position)})
    return runner


def _torch() -> tuple[Any, Any]:
    """``torch`` and ``torch.distributed``, imported when a runner is made (an optional extra);
    ``UsageError`` without torch."""
    try:
        import torch
        import torch.distributed
    except ImportError as e:
        raise UsageError(f"data-parallel training needs torch ({e}); install mpgraph[torch]") from e
    return torch, torch.distributed


def _initial_state(step: ir.Model, split: SplitStep) -> dict[str, np.ndarray]:
    """Every state input's initializer value, and ``lr``'s."""
    inits = step.graph.initializers
    names = [a for a, _ in split.state_pairs] + (["lr"] if "lr" in inits else [])
    missing = [n for n in names if n not in inits or inits[n].const_value is None]
    if missing:
        raise UsageError(f"state input '{missing[0]}' has no initial value in the step graph; build it with "
                         f"`mpgraph train-graph`, which writes one")
    return {n: inits[n].const_value.numpy() for n in names}  # type: ignore[union-attr]


def _session(model: ir.Model, threads: int | None) -> ort.InferenceSession:
    """An ORT CPU session (the CUDA path, device buckets through DLPack, is not written yet)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _input_names(session: ort.InferenceSession) -> set[str]:
    """Every input a session takes, those with initializers (the state) included."""
    return {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}


def _bind_inputs(binding: ort.IOBinding, feeds: Mapping[str, np.ndarray]) -> list[ort.OrtValue]:
    """Binds each array as an OrtValue over its memory; returns them (they must outlive the run)."""
    keep = []
    for name, value in feeds.items():
        keep.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value)))
        binding.bind_ortvalue_input(name, keep[-1])
    return keep
