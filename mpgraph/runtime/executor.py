"""``Executor``: one device running one ``Program``'s session plans.

It owns the ORT sessions (a plain one for any batch shape; on CUDA a capturing one specialised
to the first batch, ``replay``), the ring of state buffer sets on the device with one prebuilt
``IOBinding`` per set (binding ``s`` reads set ``s`` and writes set ``s + 1``), and on a
pipelined CUDA executor the stream and events that let the host launch step k+1 before step
k's loss is read. It knows nothing of datasets, metrics or checkpoints files: that is the
training loop's (``mpgraph.runtime.loop``).

The interface the loop uses, and which another executor (data parallel) provides as well:

- ``ring``, ``slot``: how many state sets and the one the next step reads;
- ``launch(batch)``: run (or enqueue) one step that reads set ``slot``; ``slot`` moves on;
- ``read(launched)``: wait for that step alone and return its loss and ``found_inf``;
- ``wait(launched_steps)``, ``rewind(n)``: drop steps (their state sets are intact);
- ``state_set(slot)``, ``set_state(values)``, ``scale_in(slot)``: the state buffers;
- ``inplace``: the state inputs whose updated values are written into their own buffers
  (every set holds the same buffer for them), so ``rewind`` cannot restore them;
- ``bind_lr(lr)``, ``lr``, ``forget_lr()``: the learning rate the steps read;
- ``predict(arrays, state, batch_size)``: the forward part on the same buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from mpgraph._ir.inplace import inplace_pairs
from mpgraph.errors import MpgraphError, UsageError, head_and_tail
from mpgraph.io import as_model
from mpgraph.lowering import SessionPlan
from mpgraph.runtime import providers
from mpgraph.runtime.forward import Forward
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.pipeline import StepEvents
from mpgraph.runtime.program import LR, Program
from mpgraph.runtime.replay import SYNC_RUNS_PER_GRAPH, Launched, Replay, run_options, signature

__all__ = ["Executor", "PIPELINE_MAX_STATE_MIB"]

logger = logging.getLogger(__name__)

#: ``pipeline=None`` pipelines only when one state set is at most this size (MiB).
PIPELINE_MAX_STATE_MIB = 512
#: How the CUDA sessions' arena grows (``provider_options`` may say otherwise): by what is
#: requested, not ORT's default next power of two. A captured step allocates only in its first
#: runs, so the extra ``cudaMalloc`` calls cost nothing later; GPT-2 small's bf16 step (its
#: capturing plan at b6bc08f) needs 4.65 GiB of arena so against 5.00 (``estimate_memory``,
#: ``benchmarks/plan_memory.py``).
ARENA_EXTEND_STRATEGY = "kSameAsRequested"


def _pipeline_default(provider: str, pipeline: bool | None, state_mib: float) -> tuple[bool | None, str]:
    """``pipeline=None`` on CUDA with one state set over ``PIPELINE_MAX_STATE_MIB``: off, and
    why; anything else is left as asked."""
    if pipeline is None and provider == "cuda" and state_mib > PIPELINE_MAX_STATE_MIB:
        return False, (f"the state is {state_mib:.0f} MiB (over {PIPELINE_MAX_STATE_MIB}): a third copy costs "
                       "more than pipelining saves on a step this size; pipeline=True forces it")
    return pipeline, ""


def _inplace_default(provider: str, inplace: bool | None, pipeline: bool | None,
                     state_mib: float) -> tuple[bool, str]:
    """Whether to update the state in place (``inplace_state``), and why not when not asked
    for: ``None`` is on for CUDA with one state set over ``PIPELINE_MAX_STATE_MIB`` unless
    pipelining is asked for (its undo needs the older sets).

    On the H200 (2026-12-03, ``tests/test_gpu_inplace.py``) the in-place steps, CUDA graphs
    and all, give the same bits as two sets, since a graph's first launch runs twice and the
    executor puts the state back before the captured replay (``_launch_replay``).

    Raises:
        UsageError: ``inplace_state=True`` with ``pipeline=True``.
    """
    if inplace and pipeline:
        raise UsageError("inplace_state=True and pipeline=True exclude each other: a pipelined step is undone "
                         "from the state set before it, which an in-place update overwrites")
    if inplace is not None:
        return inplace, "" if inplace else "inplace_state=False"
    if provider != "cuda":
        return False, "in-place state updates are a CUDA default (inplace_state=True asks for them)"
    if pipeline:
        return False, "pipeline=True keeps a state set per step in flight"
    if state_mib <= PIPELINE_MAX_STATE_MIB:
        return False, (f"the state is {state_mib:.0f} MiB (at most {PIPELINE_MAX_STATE_MIB}): its second set is "
                       "cheap and lets fit undo a non-finite step")
    return True, ""


class Executor:
    """Runs a ``Program`` on one device as ``options`` say (see the module for the interface).

    Raises:
        MpgraphError: Provider unavailable, or (CUDA) float nodes falling back to CPU.
        UsageError: ``deterministic`` with TF32, or ``pipeline=True`` without CUDA graphs.
    """

    def __init__(self, program: Program, options: RunOptions) -> None:
        self.program, self.options = program, options
        provider = self.provider = options.provider
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.device_id = options.device_id if provider == "cuda" else 0
        state_mib = sum(a.nbytes for a in program.initial.values()) / 2**20
        want_inplace, self.inplace_reason = _inplace_default(provider, options.inplace_state, options.pipeline, state_mib)
        pipeline, size_reason = _pipeline_default(provider, options.pipeline, state_mib)
        if want_inplace and pipeline is None:
            pipeline, size_reason = False, "the state is updated in place (inplace_state): a pipelined step could not be undone"
        self._events, reason = self._pipeline_events(provider, options.device_id, pipeline, options.cuda_graph)
        self.pipeline_reason = size_reason or reason
        #: Steps are launched before the previous one's result is read (see ``Trainer``).
        self.pipeline = self._events is not None
        # Three state sets when pipelined: a bad step and the one launched after it can both go.
        self.ring = 3 if self.pipeline else 2
        extra = {**(self._events.provider_options() if self._events else {}),
                 **({"arena_extend_strategy": ARENA_EXTEND_STRATEGY} if provider == "cuda" else {}),
                 **({"cudnn_conv_algo_search": "DEFAULT"} if options.deterministic and provider == "cuda" else {}),
                 **(options.provider_options or {})}
        self.tf32, self.provider_options = providers.provider_options(
            program.model.metadata_props, provider, device_id=options.device_id, tf32=options.tf32, extra=extra)
        if options.deterministic and self.tf32:
            raise UsageError("deterministic=True needs strict float32 matmuls (tf32=False): the embedding "
                             "gradient's one-hot Gemm would round its inputs to TF32")
        self._plan_options = program.plan_options(options)
        self.session = self._new_session(graph=False)
        #: Why less than the provider's default kernel rules run ("" when they all do).
        self.kernels_reason = self.plan.kernels_reason
        if self.plan.custom_ops is None:  # the specialised graph's plan must not try the build again
            self._plan_options = dataclasses.replace(
                self._plan_options, kernels=False if self.plan.scope is None else None, scope=self.plan.scope)
        #: State inputs updated in place: their outputs are bound to the inputs' own buffers.
        self.inplace: frozenset[str] = frozenset(self._inplace_safe(self.plan, want_inplace))
        self._init_replay(options)
        if provider == "cuda":
            providers.check_cuda_session(self.session, program.model, allow_cpu_fallback=options.allow_cpu_fallback)
        if self._want_graph and program.extra_outputs:
            # Outputs ORT allocates per run move between runs; a captured graph can't follow.
            self._graph_off(f"the graph has outputs beyond loss and state ({', '.join(program.extra_outputs[:3])})")
        self._init_buffers()

    def _init_replay(self, options: RunOptions) -> None:
        # CUDA graphs are captured at the first step, from a plan specialised to that batch's
        # shapes (so no shape arithmetic is left for the CPU provider).
        self._want_graph = self.provider == "cuda" and options.cuda_graph is not False
        self._require_graph = bool(options.cuda_graph)
        self.cuda_graph = False
        self.cuda_graph_reason = "" if self._want_graph else (
            "cuda_graph=False" if self.provider == "cuda" else "CUDA graphs need the cuda provider")
        self.replay: Replay | None = None

    def _init_buffers(self) -> None:
        outputs = {o.name: o for o in self.session.get_outputs()}
        found_name = self.program.found_inf_name
        # One per state set: a pipelined step's loss is read after the next step has run.
        self._loss_out = [self._out_buffer(outputs[self.program.loss_name], "cpu") for _ in range(self.ring)]
        self._found_out = [self._out_buffer(outputs[found_name], "cpu") if found_name else None for _ in range(self.ring)]
        self._keep: list[ort.OrtValue] = []
        self.lr: float | None = None  # the lr the steps read (``None``: none bound yet)
        self._lr_buf: ort.OrtValue | None = None
        self._forward = Forward(self.program, self.provider)
        self.set_state(self.program.initial)

    @staticmethod
    def _pipeline_events(provider: str, device_id: int, pipeline: bool | None,
                         cuda_graph: bool | None) -> tuple[StepEvents | None, str]:
        """The stream and events of pipelined steps (``None``: off, and why)."""
        if pipeline is False:
            return None, "pipeline=False"
        if provider != "cuda" or cuda_graph is False:
            if pipeline:
                raise UsageError("pipeline=True needs the cuda provider with CUDA graphs (cuda_graph not False)")
            return None, "pipelining needs the cuda provider with CUDA graphs"
        try:
            return StepEvents(device_id), ""
        except MpgraphError as e:
            if pipeline:
                raise
            return None, str(e)

    # -- sessions and buffers -------------------------------------------------------------

    def _inplace_safe(self, plan: SessionPlan, wanted: bool | frozenset[str]) -> list[str]:
        """The state inputs (of ``wanted``: all, or these) whose update may overwrite them in
        ``plan``'s graph (``mpgraph._ir.inplace``); a log line names the others and why."""
        if not wanted:
            return []
        safe, refused = inplace_pairs(as_model(plan.graph).graph, self.program.pairs)
        if wanted is not True:
            safe, refused = [n for n in safe if n in wanted], {n: r for n, r in refused.items() if n in wanted}
        if refused:
            first = "; ".join(f"'{n}': {r}" for n, r in list(refused.items())[:3])
            logger.log(logging.WARNING if self.options.inplace_state else logging.INFO,
                       "inplace_state: %d of %d state values keep two buffers (the update might not be the last to "
                       "read them), e.g. %s", len(refused), len(refused) + len(safe), first)
            self.inplace_reason = f"{len(refused)} state values not provably safe, e.g. {first}"
        return safe

    def _new_session(self, graph: bool, shapes: Mapping[str, tuple[int, ...]] | None = None) -> ort.InferenceSession:
        """An ORT session of the program's plan (specialised to ``shapes`` when given);
        ``graph`` turns on CUDA graph capture."""
        self.plan: SessionPlan = self.program.plan(self.provider, self._plan_options, shapes)
        #: Nodes the fused kernels replaced in the newest session's graph (0: kernels off).
        self.kernels_fused = self.plan.kernels_fused
        #: Scatter-adds and sums it runs as Gemms (``deterministic=True`` on CUDA).
        self.deterministic_rewrites = self.plan.deterministic_rewrites
        mem_pattern = self.options.mem_pattern if self.options.mem_pattern is not None else (False if graph else None)
        return providers.new_session(self.plan.graph, self.provider, self.provider_options,
                                     threads=self.options.threads, cuda_graph=graph, custom_ops=self.plan.custom_ops,
                                     mem_pattern=mem_pattern, deterministic=self.options.deterministic)

    def _out_buffer(self, output: Any, device: str) -> ort.OrtValue:
        """A buffer for a small output (the loss, ``found_inf``), shaped as declared."""
        shape = output.shape if output.shape and all(isinstance(d, int) for d in output.shape) else []
        array = np.zeros(shape, providers.ORT_TYPES.get(output.type, np.float32))
        if device == "cpu":
            return ort.OrtValue.ortvalue_from_numpy(array)
        return ort.OrtValue.ortvalue_from_numpy(array, device, self.device_id)

    def _device_value(self, array: np.ndarray) -> ort.OrtValue:
        # Not np.ascontiguousarray: it turns a scalar into shape [1].
        return ort.OrtValue.ortvalue_from_numpy(np.array(array, copy=True, order="C"), self.device, self.device_id)

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Upload ``values`` into the current state buffers, allocating every set and
        prebinding each on first use. Later calls (a checkpoint load) overwrite the buffers in
        place, so captured CUDA graphs keep reading the same addresses."""
        arrays = {name: np.asarray(values[name]) for name, _ in self.program.pairs}
        current = self.sets[self.slot] if hasattr(self, "sets") else None
        if current is not None and all(
            tuple(current[n].shape()) == a.shape and np.dtype(providers.ORT_TYPES.get(current[n].data_type(), object)) == a.dtype
            for n, a in arrays.items()
        ):
            for name, array in arrays.items():
                current[name].update_inplace(np.array(array, copy=True, order="C"))
            return
        if self.device == "cuda" and current is None:  # the first upload: one arena region for every set
            sizes = [a.nbytes for a in arrays.values()]
            sizes += [a.nbytes for name, a in arrays.items() if name not in self.inplace] * (self.ring - 1)
            providers.reserve_device_values(sizes, self.device_id)
        self.sets: list[dict[str, ort.OrtValue]] = [{} for _ in range(self.ring)]
        for name, array in arrays.items():
            self.sets[0][name] = self._device_value(array)
            for spare in self.sets[1:]:  # an in-place value has one buffer, in every set
                spare[name] = self.sets[0][name] if name in self.inplace else ort.OrtValue.ortvalue_from_shape_and_type(
                    list(array.shape), array.dtype, self.device, self.device_id)
        self.slot = 0
        self._bindings = self._ring_bindings(self.session, self._loss_out, self._found_out, self._lr_buf)
        self.replay = None  # new addresses: capture again at the next step

    def _unshare(self, names: frozenset[str]) -> None:
        """Give the state values ``names`` a buffer per set again (their update may not
        overwrite them in a new session's graph); the set in use keeps the values."""
        if not names:
            return
        for s, spare in enumerate(self.sets):
            if s != self.slot:
                for name in names:
                    value = spare[name]
                    spare[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                        value.shape(), providers.ORT_TYPES[value.data_type()], self.device, self.device_id)
        self.inplace -= names
        self._bindings = self._ring_bindings(self.session, self._loss_out, self._found_out, self._lr_buf)

    def state_set(self, slot: int | None = None) -> dict[str, ort.OrtValue]:
        """State set ``slot`` (``None``: the one the next step reads)."""
        return self.sets[self.slot if slot is None else slot]

    def rewind(self, steps: int) -> None:
        """Move along the ring of state sets (negative: back over steps whose sets are intact)."""
        self.slot = (self.slot + steps) % len(self.sets)

    def scale_in(self, slot: int) -> float | None:
        """The loss scale held in state set ``slot`` (``None``: no scaling)."""
        name = self.program.scale_name
        return float(self.sets[slot][name].numpy().reshape(-1)[0]) if name is not None else None

    def _ring_bindings(self, session: ort.InferenceSession, loss: list[ort.OrtValue],
                       found: list[ort.OrtValue | None], lr: ort.OrtValue | None) -> list[ort.IOBinding]:
        """One binding per state set: ``[s]`` reads set s, writes the next set in the ring and
        ``loss[s]``/``found[s]``."""
        n = len(self.sets)
        return [self._make_binding(session, self.sets[s], self.sets[(s + 1) % n], loss[s], found[s], lr)
                for s in range(n)]

    def _make_binding(self, session: ort.InferenceSession, read: Mapping[str, ort.OrtValue],
                      write: Mapping[str, ort.OrtValue], loss: ort.OrtValue, found: ort.OrtValue | None,
                      lr: ort.OrtValue | None) -> ort.IOBinding:
        binding = session.io_binding()
        for name, out in self.program.pairs:
            binding.bind_ortvalue_input(name, read[name])
            binding.bind_ortvalue_output(out, write[name])
        binding.bind_ortvalue_output(self.program.loss_name, loss)
        if self.program.found_inf_name is not None and found is not None:
            binding.bind_ortvalue_output(self.program.found_inf_name, found)
        for name in self.program.extra_outputs:
            binding.bind_output(name, self.device, self.device_id)
        if lr is not None:
            binding.bind_ortvalue_input(LR, lr)
        return binding

    # -- the learning rate ----------------------------------------------------------------

    def bind_lr(self, lr: float | None) -> None:
        """Bind ``lr`` for the next steps (``None``: keep the one in use, else the graph's)."""
        if not self.program.has_lr:
            if lr is not None:
                raise MpgraphError("this step graph has no 'lr' input (built without an optimizer?)")
            return
        if lr is not None and not math.isfinite(lr):
            raise UsageError(f"learning rate must be finite, got {lr}")
        value = lr if lr is not None else (self.lr if self.lr is not None else self.program.default_lr)
        if value is None or value == self.lr:
            return
        array = np.asarray(value, dtype=np.float32)
        self.lr = value
        self._lr_buf = ort.OrtValue.ortvalue_from_numpy(array)
        for binding in self._bindings:
            binding.bind_ortvalue_input(LR, self._lr_buf)
        if self.replay is not None:
            if self.replay.lr is None:
                self.replay = None  # captured without an lr binding: capture again
            else:
                self.replay.lr.update_inplace(array)  # same address: the captured graphs read it

    def forget_lr(self) -> None:
        """Drop the lr in use (a checkpoint load binds its own, or the default, next)."""
        self.lr, self._lr_buf = None, None

    # -- CUDA graphs ----------------------------------------------------------------------

    def _graph_off(self, reason: str) -> None:
        if self._require_graph:
            raise MpgraphError(f"cannot run the step as a CUDA graph: {reason}")
        self._want_graph, self.cuda_graph, self.cuda_graph_reason = False, False, reason
        logger.warning("CUDA graph capture is off: %s", reason)

    def _start_replay(self, batch: Mapping[str, np.ndarray]) -> None:
        """Build the capturing session for ``batch``'s shapes and its fixed buffers."""
        names = [spec.name for spec in self.program.data_inputs]
        sig = signature(batch, names)
        try:
            session = self._new_session(graph=True, shapes={n: shape for n, (shape, _) in sig.items()})
        except MpgraphError as e:
            self._graph_off(str(e))
            return
        if self.inplace:
            self._unshare(self.inplace - frozenset(self._inplace_safe(self.plan, self.inplace)))
        outputs = {o.name: o for o in session.get_outputs()}
        ring = range(len(self.sets))
        found_name = self.program.found_inf_name
        loss = [self._out_buffer(outputs[self.program.loss_name], self.device) for _ in ring]
        found = [self._out_buffer(outputs[found_name], self.device) if found_name else None for _ in ring]
        lr = None
        if self.lr is not None:
            lr = ort.OrtValue.ortvalue_from_numpy(np.asarray(self.lr, np.float32), self.device, self.device_id)
        bufs = [{n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(batch[n]), self.device, self.device_id)
                 for n in names} for _ in ring]
        bindings = self._ring_bindings(session, loss, found, lr)
        for binding, set_bufs in zip(bindings, bufs):
            for n, buf in set_bufs.items():
                binding.bind_ortvalue_input(n, buf)
        self.replay = Replay(session, bindings, bufs, sig, loss, found, lr, run_options(len(self.sets)))
        self.cuda_graph, self.cuda_graph_reason = True, ""

    def _launch_replay(self, replay: Replay, batch: Mapping[str, np.ndarray], slot: int) -> Launched | None:
        """Run the captured graph that reads state set ``slot`` (``None``: capture failed, and
        CUDA graphs are off from now on)."""
        replay.upload(batch, slot)
        nosync = replay.nosync(self.pipeline)
        # ORT captures a graph within its first runs and runs the step more than once while it
        # does (its runs before the capture, then the captured graph): state updated in place
        # would take every one of those updates. So a graph's first launch runs it
        # SYNC_RUNS_PER_GRAPH times, puts the state back and runs the captured graph once more.
        saved = {n: np.array(self.sets[slot][n].numpy(), copy=True) for n in sorted(self.inplace)} \
            if self.inplace and replay.runs < len(replay.bindings) else None
        try:
            replay.session.run_with_iobinding(replay.bindings[slot], replay.options[slot][nosync])
        except Exception as e:  # noqa: BLE001 - ORT raises RuntimeError/Fail types
            if nosync:  # captured already: a real failure
                raise
            # A kernel that refuses capture (e.g. Concat over 32 inputs) fails here, before
            # any state input is touched: the step runs again without graphs. ORT's message
            # says why at its end (its first line only names the node).
            self.replay = None
            self._graph_off(f"capture failed: {head_and_tail(e)}")
            return None
        if saved is not None:
            for _ in range(SYNC_RUNS_PER_GRAPH - 1):
                replay.session.run_with_iobinding(replay.bindings[slot], replay.options[slot][False])
            for name, array in saved.items():
                self.sets[slot][name].update_inplace(array)
            replay.session.run_with_iobinding(replay.bindings[slot], replay.options[slot][False])
        replay.runs += 1
        event = self._events.record() if nosync and self._events is not None else None
        return Launched(slot, batch, replay.loss[slot], replay.found[slot], event)

    # -- steps ----------------------------------------------------------------------------

    def launch(self, batch: Mapping[str, np.ndarray]) -> Launched:
        """Run one step on ``batch`` (on a pipelined executor's captured graphs, enqueue it)
        and move to the state set it writes; ``read`` gives its result."""
        slot = self.slot
        if self._want_graph and self.replay is None:
            self._start_replay(batch)
        replay = self.replay
        launched = None
        if replay is not None and replay.matches(batch):
            launched = self._launch_replay(replay, batch, slot)
        if launched is None:
            binding = self._bindings[slot]
            # The binding points into these arrays' memory: hold them until the next step.
            self._keep = []
            for spec in self.program.data_inputs:
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(batch[spec.name]))
                self._keep.append(value)
                binding.bind_ortvalue_input(spec.name, value)
            self.session.run_with_iobinding(binding)
            launched = Launched(slot, batch, self._loss_out[slot], self._found_out[slot])
        self.rewind(1)
        return launched

    @staticmethod
    def read(launched: Launched) -> tuple[float, bool]:
        """Wait for a launched step (its own event only): its loss and whether the graph
        skipped it (``found_inf``)."""
        if launched.event is not None:
            launched.event.synchronize()
        loss = float(launched.loss.numpy().reshape(-1)[0])
        found = launched.found
        return loss, bool(found.numpy().reshape(-1)[0]) if found is not None else False

    @staticmethod
    def wait(steps: list[Launched]) -> None:
        """Wait for launched steps without reading their results."""
        for step in steps:
            if step.event is not None:
                step.event.synchronize()

    # -- inspection and evaluation --------------------------------------------------------

    def node_providers(self) -> dict[str, str]:
        """Node name -> execution provider ORT assigned it (empty if this ORT cannot say)."""
        return providers.node_providers(self.session)

    def predict(self, arrays: Mapping[str, np.ndarray], state: Mapping[str, ort.OrtValue],
                batch_size: int = 512) -> np.ndarray:
        """Logits of the forward model on ``arrays``, its parameters bound to ``state``."""
        return self._forward.predict(self.session, arrays, state, batch_size)
