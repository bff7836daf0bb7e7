"""``DataParallelExecutor``: the ``Executor`` of one rank of a data-parallel run.

Every rank holds the whole model and runs the same step on its share of the global batch
(``runtime.data_parallel`` has the rules: buckets, the ordered reduction, loss scaling across
ranks, ZeRO-1). This executor runs two session plans of its ``Program`` instead of one: the
**gradient part** and the **apply part** of ``Program.split`` (``training.split_step_graph``),
each planned by ``Program.plan_part`` through ``lowering.plan_session``, so the lowering rules
apply to both parts as to a one-process step (the AdamW fusion to the apply part, the ReLU
gradient fusion to the gradient part). Between the two runs the gradients, which ORT wrote
straight into flat float32 buckets (IOBinding onto views of the bucket arrays), are reduced
across ranks (``gradient_buckets.reduce_buckets``); then the apply part reads them, and with
optimizer sharding each rank's updated share goes to the others.

The interface is ``runtime.executor``'s, so the training loop drives it as it drives one
device: ``ring`` 2 (a step reads set ``slot`` and writes the other), ``launch(batch)`` runs a
whole step synchronously on this rank's slice of the *global* batch, ``read`` gives its loss
(averaged over the global batch) and skip flag, ``rewind`` goes back over steps whose sets are
intact, ``state_set`` gives this rank's state buffers (views, no copies), ``set_state`` takes a
whole state (a rank keeps its share), ``bind_lr``/``forget_lr``, ``predict``. What a
one-device executor does not need: ``gather_state`` (the whole state, collective) for
checkpoints written by rank 0.

**Where the buffers live.** Every buffer the two sessions read or write (the state sets, the
buckets, the micro-batch scratch, the receive buffers of the ordered reduction) is a torch
tensor on the rank's device, bound to ORT through DLPack (``OrtValue.from_dlpack``: the same
memory, no copy): on the CPU provider host tensors (gloo), on ``cuda`` tensors on
``cuda:<LOCAL_RANK>`` (NCCL; ``RunOptions.device_id`` without torchrun), so NCCL reduces in
place what ORT's CUDA kernels wrote and no gradient goes through the host. The CPU and CUDA
paths are one code path that differs only in the device. Ordering on CUDA: an ORT run ends
synchronized (ORT's default), and torch's stream is drained before every ORT run, since ORT
computes on a stream of its own.

Not on CUDA yet: optimizer sharding (its gathers and broadcasts are host code; refused with a
``UsageError``), CUDA graphs and pipelining (each step is two sessions with collectives
between them), overlap of the reduction with the backward (one ORT run makes every gradient).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from mpgraph._ir import meta as md
from mpgraph.errors import MpgraphError, UsageError
from mpgraph.io import as_model
from mpgraph.runtime import providers
from mpgraph.runtime.executor import Executor
from mpgraph.runtime.forward import Forward
from mpgraph.runtime.gradient_buckets import make_buckets, pairwise_sum, reduce_buckets
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.program import LR, Program
from mpgraph.runtime.rank_device import check_backend, place_rank, torch_modules
from mpgraph.runtime.replay import Launched
from mpgraph.training.shard_flat_slot import FlatSlot, flat_slots, slice_range
from mpgraph.training.split_step_graph import deal_groups, optimizer_groups, shard_apply_part

if TYPE_CHECKING:
    import torch.distributed

    from mpgraph.lowering import SessionPlan

__all__ = ["DataParallelExecutor", "DataParallelOptions", "shard_batch"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataParallelOptions:
    """How a data-parallel executor reduces and updates.

    Attributes:
        bucket_bytes: Bytes of gradients per bucket (one collective each; torch DDP's 25 MiB).
        reduction: ``ordered`` (all_to_all, a fixed summation tree, all_gather: fixed float32 bits) or
            ``all_reduce`` (one sum collective: less traffic, order-dependent bits beyond 2 ranks).
        micro_batches: Slices of each rank's batch run one after the other and summed (a
            power of two keeps the bits independent of the world size).
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


class DataParallelExecutor:
    """One rank's sessions, buckets and state for a ``Program`` (see the module).

    It provides the executor interface of ``runtime.executor`` (what ``TrainingLoop`` drives)
    without being an ``Executor``: that one's constructor builds a session of the whole step
    and a ring of state sets this executor has no use for. What the two share is used, not
    inherited: ``read`` and ``wait`` are ``Executor``'s static methods, ``predict`` is
    ``runtime.forward.Forward`` on this rank's state.

    Args:
        program: The step graph's program (the same on every rank).
        options: How the sessions run: ``provider`` ``cpu`` (gloo) or ``cuda`` (NCCL, each
            rank on ``cuda:<LOCAL_RANK>``); ``threads``, ``kernels``, ``tf32`` reach the plans
            and sessions.
        parallel: Buckets, reduction, micro-batches, optimizer sharding.
        group: The process group (``None``: the default one if initialized, else world size 1).

    Raises:
        MpgraphError: ``cuda`` without a CUDA torch, a visible GPU for this rank, ORT's CUDA
            provider or an NCCL group; ``cpu`` in an NCCL group.
        UsageError: ``shard_optimizer`` on ``cuda``; a provider other than ``cpu``/``cuda``.
    """

    read = staticmethod(Executor.read)
    wait = staticmethod(Executor.wait)

    def __init__(self, program: Program, options: RunOptions, parallel: DataParallelOptions | None = None,
                 group: torch.distributed.ProcessGroup | None = None) -> None:
        self.program, self.options = program, options
        self.parallel = parallel or DataParallelOptions()
        self._torch, self._dist = torch_modules()
        self.group = group
        grouped = self.grouped = self._dist.is_available() and self._dist.is_initialized()
        self.rank = self._dist.get_rank(group) if grouped else 0
        self.world = self._dist.get_world_size(group) if grouped else 1
        self._one_device_fields(grouped)
        self.split = program.split
        self.params = tuple(p for p, _ in self.split.gradients)
        shard = self.parallel.shard_optimizer
        self.slots = flat_slots(self.split.apply, list(self.split.state_pairs), set(self.params)) if shard else []
        self._slot_of = {n: slot for slot in self.slots for n in slot.state}
        self.owners = self._deal_groups(program.initial) if shard else {}
        self._outputs = dict(self.split.state_pairs)
        # A rank updates the state it owns; the parameters it does not own come from their owner.
        held = {self._outputs[n] for n, _ in self.split.state_pairs if self._holds(n)
                and self.owners.get(n, self.rank) == self.rank}
        apply_part = shard_apply_part(self.split, held, self.slots, self.rank, self.world) if shard else self.split.apply
        plan_options = program.plan_options(options)
        #: The session plans of the two parts (``lowering.plan_session``'s, via ``Program.plan_part``).
        self.plans: dict[str, SessionPlan] = {"gradient": program.plan_part(self.split.gradient, self.provider, plan_options),
                                              "apply": program.plan_part(apply_part, self.provider, plan_options)}
        self.plan = self.plans["gradient"]
        self.session = self._part_session(self.plans["gradient"])
        self._apply_session = self._part_session(self.plans["apply"])
        self._forward = Forward(program, self.provider)
        self.kernels_reason = self.plan.kernels_reason
        self.kernels_fused = sum(p.kernels_fused for p in self.plans.values())
        self._init_bucket_buffers()
        self.set_state(program.initial)

    def _one_device_fields(self, grouped: bool) -> None:
        """What the loop and the ``Trainer`` face read of an executor, as this one has it."""
        provider = self.provider = self.options.provider
        self.device, self.device_id = place_rank(provider, self.options.device_id, self.rank, self.world)
        backend = self._dist.get_backend(self.group) if grouped else None
        check_backend(provider, backend)
        if provider == "cuda":
            self._torch.cuda.set_device(self.device_id)
            if self.parallel.shard_optimizer:
                raise UsageError("shard_optimizer runs on the cpu provider only for now: its gathers and broadcasts "
                                 "of the updated parameters are host code; train on cuda without it")
        self.torch_device = self._torch.device(self.device if provider != "cuda" else f"cuda:{self.device_id}")
        self.pipeline, self.pipeline_reason, self.ring = False, "data-parallel steps run one at a time", 2
        self.tf32, self.provider_options = providers.provider_options(
            self.program.model.metadata_props, provider, device_id=self.device_id, tf32=self.options.tf32,
            extra=self.options.provider_options)
        self.cuda_graph, self.replay = False, None
        self.cuda_graph_reason = ("a data-parallel step is two sessions with collectives between them"
                                  if provider == "cuda" else "CUDA graphs need the cuda provider")
        self.deterministic_rewrites = 0
        self.lr: float | None = None
        self._lr_array: np.ndarray | None = None
        self._bindings_of: dict[tuple[object, ...], tuple[ort.IOBinding, list[ort.OrtValue]]] = {}

    def _part_session(self, plan: SessionPlan) -> ort.InferenceSession:
        session = providers.new_session(plan.graph, self.provider, self.provider_options,
                                        threads=self.parallel.threads or self.options.threads,
                                        custom_ops=plan.custom_ops, mem_pattern=self.options.mem_pattern)
        if self.provider == "cuda":
            providers.check_cuda_session(session, as_model(plan.graph), allow_cpu_fallback=self.options.allow_cpu_fallback)
        return session

    def _sync(self) -> None:
        """Wait for the work torch queued on this rank's GPU (collectives, sums, copies): ORT
        runs on a stream of its own and would not wait for it. Nothing to wait for on CPU."""
        if self.provider == "cuda":
            self._torch.cuda.current_stream(self.torch_device).synchronize()

    def _zeros(self, size: int) -> Any:
        """A flat float32 tensor of zeros on this rank's device."""
        return self._torch.zeros(size, dtype=self._torch.float32, device=self.torch_device)

    def _init_bucket_buffers(self) -> None:
        shapes = {g: self.program.initial[p].shape for p, g in self.split.gradients}
        self.buckets = make_buckets(self.split, shapes, self.parallel.bucket_bytes, self.world)
        count = self.parallel.micro_batches
        # Slices in flight in the pairwise sum: one per level of the stack, and the one running.
        sets = int(np.ceil(np.log2(count))) + 2 if count > 1 else 0
        self._scratch = [[self._zeros(len(b.array)) for b in self.buckets] for _ in range(sets)]
        #: The buckets: torch tensors on this rank's device (on CPU over the layout's arrays,
        #: ``torch.from_numpy``). ORT writes the gradients into their views through DLPack and
        #: the collectives reduce them in place: on a GPU, NCCL reduces what ORT wrote.
        self.bucket_tensors = [self._torch.from_numpy(b.array) if self.provider == "cpu" else self._zeros(len(b.array))
                               for b in self.buckets]
        self._received = ([self._zeros(len(b.array)) for b in self.buckets]
                          if self.grouped and self.parallel.reduction == "ordered" else [])

    def bucket_views(self) -> dict[str, Any]:
        """Each gradient's (and the loss's) view of the bucket tensors, by value name."""
        return {n: v for b, t in zip(self.buckets, self.bucket_tensors, strict=True) for n, v in b.views(t).items()}

    def gradient_outputs(self) -> dict[str, ort.OrtValue]:
        """The gradient part's outputs as the last step's binding wrote them (without
        micro-batches: the bucket views for gradients and loss, the same memory)."""
        binding, _ = self._bindings_of[("gradient", 1 - self.slot, id(self.bucket_tensors[0]))]
        return dict(zip([o.name for o in self.session.get_outputs()], binding.get_outputs(), strict=True))

    # -- the state ------------------------------------------------------------------------

    @property
    def _state(self) -> dict[str, Any]:
        """This rank's state tensors of the current set."""
        return self.sets[self.slot]

    def _state_np(self) -> dict[str, np.ndarray]:
        """The current set as numpy arrays over the same memory (CPU only: the sharding code)."""
        return {n: t.numpy() for n, t in self._state.items()}

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Take a whole state (every state input): this rank keeps its share, into the current
        set in place (the bindings keep their addresses) or, the first time, new sets."""
        torch = self._torch
        shares = {n: torch.from_numpy(np.array(self._share(n, np.asarray(values[n])), copy=True, order="C"))
                  for n, _ in self.split.state_pairs if self._holds(n)}
        current = self.sets[self.slot] if hasattr(self, "sets") else None
        if current is not None and all(current[n].shape == a.shape for n, a in shares.items()):
            for name, tensor in shares.items():
                current[name].copy_(tensor)
            self._sync()
            return
        self.sets = [{n: t.to(self.torch_device) for n, t in shares.items()},
                     {n: torch.empty_like(t, device=self.torch_device) for n, t in shares.items()}]
        self._sync()
        self.slot = 0
        self._bindings_of = {}

    def state_set(self, slot: int | None = None) -> dict[str, ort.OrtValue]:
        """This rank's state buffers of set ``slot`` (``None``: the next step's), as OrtValues
        over the same memory (DLPack)."""
        return {n: _ort_value(t) for n, t in self.sets[self.slot if slot is None else slot].items()}

    @property
    def held(self) -> dict[str, np.ndarray]:
        """This rank's state arrays of the current set (on CPU the buffers themselves, on CUDA
        host copies)."""
        return {n: t.numpy() if self.provider == "cpu" else t.cpu().numpy() for n, t in self._state.items()}

    def scale_in(self, slot: int) -> float | None:
        name = self.program.scale_name
        return float(self.sets[slot][name].reshape(-1)[0]) if name is not None else None

    def rewind(self, steps: int) -> None:
        self.slot = (self.slot + steps) % 2

    def bind_lr(self, lr: float | None) -> None:
        """``Executor.bind_lr``: ``lr`` for the next steps (``None``: the one in use, else the graph's)."""
        if lr is not None and not self.program.has_lr:
            raise MpgraphError("this step graph has no 'lr' input (built without an optimizer?)")
        if lr is not None and not math.isfinite(lr):
            raise UsageError(f"learning rate must be finite, got {lr}")
        if lr is not None or self.lr is None:
            value = lr if lr is not None else self.program.default_lr
            if value is not None:
                self.lr, self._lr_array = value, np.asarray(value, dtype=np.float32)

    def forget_lr(self) -> None:
        self.lr, self._lr_array = None, None

    def node_providers(self) -> dict[str, str]:
        return {**providers.node_providers(self.session), **providers.node_providers(self._apply_session)}

    def predict(self, arrays: Mapping[str, np.ndarray], state: Mapping[str, ort.OrtValue],
                batch_size: int = 512) -> np.ndarray:
        """``Executor.predict``: the forward plan on ``arrays``, its parameters bound to ``state``."""
        return self._forward.predict(self.session, arrays, state, batch_size)

    # -- steps ----------------------------------------------------------------------------

    def launch(self, batch: Mapping[str, np.ndarray]) -> Launched:
        """One whole step on this rank's slice of the global ``batch`` (collective: every rank
        calls it with the same batch); ``read`` gives the loss over the global batch."""
        slot = self.slot
        loss, skipped = self.run(shard_batch(batch, self.rank, self.world))
        return Launched(slot, batch, ort.OrtValue.ortvalue_from_numpy(np.array(loss, np.float32)),
                        ort.OrtValue.ortvalue_from_numpy(np.array(skipped)))

    def run(self, share: Mapping[str, np.ndarray]) -> tuple[float, bool]:
        """One step on this rank's share of the batch: its loss averaged over the global batch
        and whether loss scaling skipped it (the same on every rank)."""
        self.bind_lr(None)
        passthrough = self._gradients(share)
        self._reduce()
        skipped, outputs = self._apply(passthrough)
        for slot in self.slots:
            self._unpack(slot, all_gather_flat(self._dist, self.group, outputs[slot.output].numpy(), slot.size))
        if self.parallel.shard_optimizer and self.world > 1:
            self._broadcast_params()
        return float(self.buckets[-1].views(self.bucket_tensors[-1])[self.split.loss]), skipped

    def _gradients(self, feeds: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        """The gradient part over the micro-batches, summed pairwise into the buckets."""
        count = self.parallel.micro_batches
        if count == 1:
            return self._run_gradient(feeds, self.bucket_tensors)
        pool = list(self._scratch)
        passthrough: dict[str, ort.OrtValue] = {}

        def slices() -> Iterator[list[Any]]:
            nonlocal passthrough
            for k in range(count):
                arrays = pool.pop()
                passthrough = self._run_gradient(shard_batch(feeds, k, count), arrays)
                yield arrays

        total = pairwise_sum(slices(), pool.append)
        for bucket, tensor in zip(self.bucket_tensors, total, strict=True):
            bucket.copy_(tensor)
        pool.append(total)
        return passthrough

    def _run_gradient(self, feeds: Mapping[str, np.ndarray], tensors: list[Any]) -> dict[str, ort.OrtValue]:
        """The gradient part on one slice, its gradients and loss written into ``tensors``
        (one per bucket); returns the passthrough values. Only the batch is bound anew."""
        key = ("gradient", self.slot, id(tensors[0]))
        if key not in self._bindings_of:
            views = {n: v for b, t in zip(self.buckets, tensors, strict=True) for n, v in b.views(t).items()}
            self._bindings_of[key] = self._binding(self.session, {}, views)
        binding, _ = self._bindings_of[key]
        keep = _bind_inputs(binding, feeds)
        self._sync()  # a slice's scratch may still be summed by torch
        self.session.run_with_iobinding(binding)
        del keep
        if not self.split.passthrough:
            return {}
        made = dict(zip([o.name for o in self.session.get_outputs()], binding.get_outputs(), strict=True))
        return {n: made[n] for n in self.split.passthrough}

    def _binding(self, session: ort.InferenceSession, extra: Mapping[str, Any],
                 outputs: Mapping[str, Any]) -> tuple[ort.IOBinding, list[ort.OrtValue]]:
        """A binding that reads the current state set (and ``extra``) and writes each output
        named in ``outputs`` into its tensor, ``found_inf`` to the host and the others to new
        buffers on the device, in session order (so ``get_outputs`` lines up). Made once per
        state set and buffer set: the tensors are only ever written in place."""
        wanted = _input_names(session)
        binding = session.io_binding()
        keep = _bind_inputs(binding, {n: a for n, a in {**self._state, **extra}.items() if n in wanted})
        for name in (o.name for o in session.get_outputs()):
            if name in outputs:
                keep.append(_ort_value(outputs[name]))
                binding.bind_ortvalue_output(name, keep[-1])
            elif name == md.FOUND_INF:
                binding.bind_output(name, "cpu")
            else:  # passthrough values, a packed slot's slice of the new parameter
                binding.bind_output(name, self.device, self.device_id)
        return binding, keep

    def _reduce(self) -> None:
        """The buckets reduced across ranks, then the mean over slices."""
        # In a group of one rank too: the sum of one term changes no bit, and the collectives run
        # (a one-GPU NCCL run exercises the path the N-GPU run takes).
        if self.grouped:
            reduce_buckets(self.bucket_tensors, self._received, self._dist, self.group,
                           self.parallel.reduction == "ordered")
        slices = self.world * self.parallel.micro_batches
        if slices != 1:
            for tensor in self.bucket_tensors:
                tensor.div_(float(slices))  # float32 / float32, correctly rounded as numpy's
        self._sync()

    def _apply(self, passthrough: Mapping[str, ort.OrtValue]) -> tuple[bool, dict[str, ort.OrtValue]]:
        """The apply part on the reduced buckets, into the other state set; returns whether the
        step was skipped, and the outputs not bound to state buffers."""
        session = self._apply_session
        key = ("apply", self.slot)
        if key not in self._bindings_of:
            views = self.bucket_views()
            spare = self.sets[1 - self.slot]
            self._bindings_of[key] = self._binding(session, views, {self._outputs[n]: a for n, a in spare.items()})
        binding, _ = self._bindings_of[key]
        wanted = _input_names(session)
        keep = _bind_inputs(binding, {LR: self._lr_array} if LR in wanted and self._lr_array is not None else {})
        for name, value in passthrough.items():
            if name in wanted:
                binding.bind_ortvalue_input(name, value)
        session.run_with_iobinding(binding)
        del keep
        outputs = dict(zip([o.name for o in session.get_outputs()], binding.get_outputs(), strict=True))
        self.rewind(1)
        return (bool(outputs[md.FOUND_INF].numpy()) if md.FOUND_INF in outputs else False), outputs

    # -- optimizer sharding ---------------------------------------------------------------

    def _deal_groups(self, initial: Mapping[str, np.ndarray]) -> dict[str, int]:
        """The owner of every grouped state input (``training.deal_groups``)."""
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

    def _unpack(self, slot: FlatSlot, flat: np.ndarray) -> None:
        """The new flat parameter of a packed slot into its parameters' state buffers."""
        start, state = 0, self._state_np()
        for name, size in slot.members:
            state[name][...] = flat[start:start + size].reshape(state[name].shape)
            start += size

    def _broadcast_params(self) -> None:
        """Each owner's updated parameters, one flat broadcast per owner."""
        torch, dist, state = self._torch, self._dist, self._state_np()
        for owner in range(self.world):
            names = [p for p in self.params if self.owners.get(p) == owner]
            if not names:
                continue
            if owner == self.rank:
                flat = np.concatenate([state[p].ravel() for p in names])
            else:
                flat = np.empty(sum(state[p].size for p in names), np.float32)
            source = owner if self.group is None else dist.get_global_rank(self.group, owner)
            dist.broadcast(torch.from_numpy(flat), src=source, group=self.group)
            if owner != self.rank:
                start = 0
                for p in names:
                    size = state[p].size
                    state[p][...] = flat[start:start + size].reshape(state[p].shape)
                    start += size

    def broadcast_object_list(self, objects: list[Any]) -> None:
        """Rank 0's ``objects`` into every rank's list, in place (collective)."""
        if self.world > 1:
            source = 0 if self.group is None else self._dist.get_global_rank(self.group, 0)
            self._dist.broadcast_object_list(objects, src=source, group=self.group)

    def gather_state(self, *, everyone: bool) -> dict[str, np.ndarray] | None:
        """The whole state in ``state_pairs`` order (collective: sharded moments are gathered)
        on rank 0, or on every rank with ``everyone``; ``None`` elsewhere."""
        dist = self._dist
        held = {n: a.copy() for n, a in self.held.items()}
        if self.parallel.shard_optimizer and self.world > 1:
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


def all_gather_flat(dist: Any, group: Any, part: np.ndarray, size: int) -> np.ndarray:
    """Every rank's slice (``slice_range``) of a ``size``-element float32 vector, in rank order
    (padded to one length for the collective; host memory: the sharded optimizer's)."""
    import torch

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return part
    ranges = [slice_range(size, r, world) for r in range(world)]
    width = max(b - a for a, b in ranges)
    padded = np.zeros(width, np.float32)
    padded[:part.size] = part
    gathered = [torch.empty(width) for _ in range(world)]
    dist.all_gather(gathered, torch.from_numpy(padded), group=group)
    return np.concatenate([t.numpy()[:b - a] for t, (a, b) in zip(gathered, ranges, strict=True)])


def _input_names(session: ort.InferenceSession) -> set[str]:
    """Every input a session takes, those with initializers (``lr``) included."""
    return {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}


def _ort_value(value: Any) -> ort.OrtValue:
    """An OrtValue over ``value``'s memory: a numpy array, or a torch tensor (host or GPU)
    through DLPack."""
    if isinstance(value, np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(value)
    return ort.OrtValue.from_dlpack(value)


def _bind_inputs(binding: ort.IOBinding, feeds: Mapping[str, Any]) -> list[ort.OrtValue]:
    """Binds each array or tensor as an OrtValue over its memory; returns them (they must
    outlive the run)."""
    keep = []
    for name, value in feeds.items():
        keep.append(_ort_value(np.ascontiguousarray(value) if isinstance(value, np.ndarray) else value))
        binding.bind_ortvalue_input(name, keep[-1])
    return keep
