"""Train a step graph on ONNX Runtime (CPU or CUDA) with state resident on the device.

A ``Trainer`` owns one ORT session of a training step graph (``build_training_graph``,
optionally converted by ``mpgraph.convert``). Every state input of ``MODEL_STATE_PAIRS``
(parameters, optimizer moments, step counter, running statistics and, with loss scaling,
``loss_scale`` and its growth tracker) lives in an ``OrtValue`` on the provider's device.
Two buffer sets and two prebuilt ``IOBinding`` objects alternate: binding A reads set 1 and
writes set 2, binding B the reverse. A step binds only the batch, runs, and copies back the
loss (and ``found_inf``/the loss scale when the graph has them), nothing else.

Before the first step the session rules of ``mpgraph.runtime.providers`` apply: the provider
must exist and be able to run the graph, and on CUDA no float node may fall back to CPU
unless ``allow_cpu_fallback=True``. ``node_providers()`` returns the assignment.

Checkpoints (``save_checkpoint``, ``mpgraph.runtime.checkpoint``) hold every state buffer,
the step count, the data stream position, the lr and a fingerprint of the graph;
``load_checkpoint`` refuses one from another graph, and continuing after it reproduces the
uninterrupted run bit for bit on CPU: ``fit`` goes on with the checkpoint's batch size and seed
when none is given and refuses other ones, or other data (``stream_settings``).

Accuracy (``evaluate``): the forward part of the step graph (from the data inputs and
parameters to the logits, ``session.forward_model``) runs in an inference session on the
same provider, whose parameter inputs are bound to the trainer's state buffers, so
evaluation copies no weights.

Example:
    >>> import numpy as np
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05)
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((256, 4)).astype(np.float32)
    >>> data = {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}
    >>> trainer = Trainer(step, provider="cpu", threads=1)
    >>> metrics = trainer.fit(data, steps=60, batch_size=32)
    >>> metrics.loss[-1] < metrics.loss[0], trainer.evaluate(data)["accuracy"] > 0.9
    (True, True)
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from mpgraph._ir import meta as md
from mpgraph.data import (
    Batches,
    Dataset,
    InputSpec,
    check_labels,
    data_digest,
    dataset_for_model,
    token_input,
)
from mpgraph.errors import CheckpointError, MpgraphError, TrainingError, UsageError
from mpgraph.io import ModelLike, as_model, as_proto
from mpgraph.lowering import PlanOptions, SessionPlan, plan_session
from mpgraph.runtime import probe, providers
from mpgraph.runtime.checkpoint import (
    MetricsLog,
    graph_fingerprint,
    read_checkpoint,
    write_checkpoint,
)
from mpgraph.runtime.metrics import Metrics, StepResult
from mpgraph.runtime.pipeline import StepEvents

__all__ = [
    "Trainer",
    "run_training",
    "stop_on_signals",
    "StopRequest",
    "FinalCheckpointError",
    "NONFINITE_MODES",
    "COLLAPSE_SKIPS",
    "PIPELINE_MAX_STATE_MIB",
]

logger = logging.getLogger(__name__)

_LR = "lr"
#: ``fit(on_nonfinite=...)``: what a non-finite batch or loss does.
NONFINITE_MODES = ("stop", "skip", "ignore")
#: ``Trainer(pipeline=None)`` pipelines only when one state set is at most this size (MiB).
PIPELINE_MAX_STATE_MIB = 512
#: Consecutive skipped steps after which the loss scale counts as collapsed (a warning).
COLLAPSE_SKIPS = 20
#: ``fit``'s batch size and shuffle seed when neither the call nor a resumed checkpoint gives one.
DEFAULT_BATCH_SIZE, DEFAULT_SEED = 64, 0


class FinalCheckpointError(CheckpointError):
    """``run_training`` finished its steps but the checkpoint at the end was not written.

    The run itself is done: ``stop`` and ``seconds`` are what ``run_training`` would have
    returned, so a caller can still write its reports and summary before the error.
    """

    def __init__(self, message: str, stop: StopRequest, seconds: float) -> None:
        super().__init__(message)
        self.stop = stop
        self.seconds = seconds


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def _state_pairs(model: ir.Model) -> list[tuple[str, str]]:
    raw = model.metadata_props.get(md.MODEL_STATE_PAIRS)
    if raw is None:
        raise MpgraphError("not a training step graph (no mpgraph.state_pairs metadata); build one with `mpgraph train-graph`")
    return [(a, b) for a, b in json.loads(raw)]


def _data_inputs(model: ir.Model, state_names: set[str]) -> list[InputSpec]:
    """The graph inputs a batch feeds: every input but the state and the lr."""
    return [
        InputSpec(v.name, np.dtype(v.dtype.numpy() if v.dtype is not None else np.float32),
                  tuple(d if isinstance(d, int) else str(d) for d in v.shape) if v.shape is not None else None)
        for v in model.graph.inputs if v.name and v.name not in state_names and v.name != _LR
    ]



def _loss_scale_state(props: Mapping[str, str], outputs: set[str], state: set[str]) -> tuple[str | None, str | None]:
    """The ``found_inf`` output and the loss-scale state input of a step graph (each ``None``
    when absent; static scaling has no scale input), as ``MODEL_LOSS_SCALE_STATE`` records them."""
    raw = props.get(md.MODEL_LOSS_SCALE_STATE)
    if raw is None:
        # Step graphs saved before the record existed: the names loss scaling gives its state.
        return (md.FOUND_INF if md.FOUND_INF in outputs else None), (md.LOSS_SCALE if md.LOSS_SCALE in state else None)
    record = json.loads(raw)
    found, scale = record.get("found_inf"), record.get("scale")
    return (found if found in outputs else None), (scale if scale in state else None)


def _nonfinite_arrays(batch: Mapping[str, np.ndarray]) -> str | None:
    """``"N non-finite values in 'x'"`` for the first float array with NaN/inf, else ``None``."""
    for name, a in batch.items():
        a = np.asarray(a)
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            return f"{int((~np.isfinite(a)).sum())} non-finite value(s) (NaN or inf) in '{name}'"
    return None


#: Runs of each captured graph in sync before a pipelined trainer enqueues it without ORT's
#: end-of-run sync (ORT captures a graph within its first runs, and a capture in a run that does
#: not synchronise failed on the DQN: CUDA error 901 at cudaStreamEndCapture).
_SYNC_RUNS_PER_GRAPH = 2


@dataclass
class _Replay:
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


@dataclass
class _Launched:
    """A step that ran, or was enqueued on a pipelined trainer; ``_finish`` reads its result."""

    slot: int  # the state set it read; its loss and found_inf buffers have the same index
    batch: Mapping[str, np.ndarray]
    loss: ort.OrtValue
    found: ort.OrtValue | None
    event: Any = None  # pipelined: a CUDA event recorded after it
    start: float = 0.0
    step: int = 0
    position: tuple[int, int] | None = None  # fit: the data position before its batch


def _pipeline_default(provider: str, pipeline: bool | None, state_mib: float) -> tuple[bool | None, str]:
    """``Trainer(pipeline=None)`` on CUDA with one state set over ``PIPELINE_MAX_STATE_MIB``:
    off, and why; anything else is left as asked."""
    if pipeline is None and provider == "cuda" and state_mib > PIPELINE_MAX_STATE_MIB:
        return False, (f"the state is {state_mib:.0f} MiB (over {PIPELINE_MAX_STATE_MIB}): a third copy costs "
                       "more than pipelining saves on a step this size; pipeline=True forces it")
    return pipeline, ""


class _FitReport:
    """What ``fit`` does with each finished step's result, in order: the collapse warning,
    the callback and the progress log."""

    def __init__(self, trainer: Trainer, steps: int, callback: Callable[[int, StepResult], None] | None,
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


class Trainer:
    """Runs a training step graph on ORT with its state kept on the device.

    Args:
        model: A training step graph (onnx-ir, protobuf, bytes or path).
        provider: ``cpu`` or ``cuda``.
        device_id: CUDA device ordinal.
        threads: Intra-op threads (``None``: ORT's default).
        allow_cpu_fallback: On CUDA, accept float nodes that ORT assigns to the CPU provider.
        track_scale: Read the loss scale back every step (one fp32 scalar) for the metrics.
        state: Initial state values overriding the graph's initializers.
        provider_options: Extra options for the execution provider (ORT's names and string
            values, e.g. ``{"cudnn_conv_algo_search": "HEURISTIC"}``); they win over the ones
            the trainer derives.
        tf32: Let float32 matmuls run as TF32 on CUDA. ``None`` reads the graph's policy
            (``mpgraph.tf32``, set by the ``tf32`` preset); absent means strict float32
            (``use_tf32=0``), because ORT's CUDA provider would otherwise use TF32 silently.
        cuda_graph: Capture the step as CUDA graphs and replay them (one per state-buffer
            parity). ``None``: on for CUDA where ORT can capture it. Needs every batch to have
            the first batch's shapes; a batch of another shape runs in a plain session.
            ``cuda_graph_reason`` says why capture is off when it is.
        kernels: Run the session's copy of the graph with mpgraph's fused kernels
            (``mpgraph.lowering.lower``: multi-tensor AdamW, casts and loss-scale unscale,
            bit-identical; the LayerNorm, GELU, attention-softmax, Relu and cross-entropy
            backwards, equal within float32 rounding; on CPU, convolutions on ORT's NCHWc
            kernels). ``None``: each provider's default (``kernels.lower(scope="default")``):
            all of it on CUDA where the library builds (needs ``nvcc``); on CPU the
            convolutions, AdamW and the Relu backward (the convolutions alone where no C++
            compiler builds the library). ``True``: all of it (fails if the library cannot be
            built). ``kernels_reason`` says why less than the default runs.
        pipeline: Pipeline the steps of ``fit`` and ``step_many`` on CUDA: the host uploads
            and launches step k+1 while the GPU runs step k, and reads step k's loss once that
            step's event has passed, so it never waits for the GPU every step. ORT then
            computes on a CUDA stream the trainer owns (torch's, as the provider's
            ``user_compute_stream``), and the state has three buffer sets instead of two, so
            that a step whose loss comes back non-finite can still be undone with the step
            launched after it (``fit``'s ``on_nonfinite`` works as without pipelining). The
            results are the same bits as ``step`` one batch at a time. ``None``: on for
            ``cuda`` with CUDA graphs where torch sees the GPU (``pipeline_reason`` says why
            not). ``None`` also leaves it off when one state set is over
            ``PIPELINE_MAX_STATE_MIB``: there a step takes long enough that the host's time per
            step hardly counts (the bench GPT, 1.4 GB of state: 13.32 against 13.51 ms a step)
            and the third set costs real memory (7.3 against 5.4 GiB);
            ``benchmarks/results/gpu_step_2026-12-01T17_b.log``. ``False`` saves the third set.
        deterministic: The same bits every run on CUDA: ORT's ``use_deterministic_compute``
            (its reductions then add without atomics), cuDNN's fixed default convolution
            algorithm instead of a timed search (``cudnn_conv_algo_search=DEFAULT``, unless
            ``provider_options`` sets it), the embedding gradient's scatter-add as a
            one-hot ``Gemm`` and the bias gradients' sums as ``MatMul``s with ones (cuBLAS
            instead of ORT's deterministic reductions, which run on cuDNN;
            ``mpgraph.lowering.deterministic``; CUDA only: ORT CPU's adds in order). Needs
            strict float32 matmuls. Without it two CUDA runs of the bench GPT part after one step (bias
            gradients, the token embedding) and the DQN's (cuDNN's algorithm per session,
            ``benchmarks/results/repeat_probe_state_diff.txt``); with it the GPT's state is
            the same bits after every step (``repeat_probe_state_diff_deterministic.txt``;
            with the sums on cuBLAS ``repeat_probe_state_diff_deterministic_sums.txt``, bf16),
            at 14.6 against 13.7 ms a bf16 step (18.8 with cuDNN's sums) and 69.3
            against 68.2 fp32 (``gpu_step_2026-12-01T23_deterministic_gpt_sums.log``). The DQN was
            bit-reproducible with the default algorithm (not with the heuristic or timed
            choice); its speed that way is not measured.
        mem_pattern: ORT's memory pattern (``SessionOptions.enable_mem_pattern``): from the
            second run on, one planned block for every intermediate, on top of the arena
            regions the first run made, so activations are held about twice. ``None``: off for
            the sessions that capture CUDA graphs (a captured step allocates nothing per run
            anyway: the bench GPT's bf16 step holds 6.4 instead of 10.5 GiB at the same speed,
            ``benchmarks/results/mem_pattern_ab.log``), ORT's default (on) otherwise.

    Raises:
        MpgraphError: Not a step graph, provider unavailable, a native low-precision graph on
            CPU, or (CUDA) float nodes falling back to CPU.
    """

    def __init__(
        self,
        model: ModelLike,
        provider: str = "cpu",
        *,
        device_id: int = 0,
        threads: int | None = None,
        allow_cpu_fallback: bool = False,
        track_scale: bool = True,
        state: Mapping[str, np.ndarray] | None = None,
        provider_options: Mapping[str, str] | None = None,
        tf32: bool | None = None,
        cuda_graph: bool | None = None,
        kernels: bool | None = None,
        mem_pattern: bool | None = None,
        pipeline: bool | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model = as_model(model)
        self.pairs: list[tuple[str, str]] = _state_pairs(self.model)
        self.provider = provider
        #: Notes about running this graph on ``provider`` (``mpgraph.targets.check_runnable``,
        #: which refuses a graph converted for a target whose kernels ``provider`` lacks).
        self.notes: list[str] = providers.check_provider(self.model, provider)
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.device_id = device_id if provider == "cuda" else 0
        initial = self._prepare_graph(state)
        pipeline, size_reason = _pipeline_default(provider, pipeline, sum(a.nbytes for a in initial.values()) / 2**20)
        self._events, reason = self._pipeline_events(provider, device_id, pipeline, cuda_graph)
        self.pipeline_reason = size_reason or reason
        #: Steps of ``fit``/``step_many`` run pipelined (see ``pipeline``).
        self.pipeline = self._events is not None
        # Three state sets when pipelined: a bad step and the one launched after it can both go.
        self._ring = 3 if self.pipeline else 2
        self._inflight: list[_Launched] = []  # launched steps whose results are not read yet
        self._deterministic = deterministic
        extra = {**(self._events.provider_options() if self._events else {}),
                 **({"cudnn_conv_algo_search": "DEFAULT"} if deterministic and provider == "cuda" else {}),
                 **(provider_options or {})}
        self.tf32, self.provider_options = providers.provider_options(
            self.model.metadata_props, provider, device_id=device_id, tf32=tf32, extra=extra)
        if deterministic and self.tf32:
            raise UsageError("deterministic=True needs strict float32 matmuls (tf32=False): the embedding "
                             "gradient's one-hot Gemm would round its inputs to TF32")
        self._threads = threads
        self._mem_pattern = mem_pattern
        block = probe.nchwc_block() if provider != "cuda" and kernels is not False else 0
        self._plan_options = PlanOptions(kernels=kernels, deterministic=deterministic, nchwc_block=block)
        self.session = self._new_session(graph=False)
        #: Why less than the provider's default kernel rules run ("" when they all do).
        self.kernels_reason = self._plan.kernels_reason
        if self._plan.custom_ops is None:  # the specialised graph's plan must not try the build again
            self._plan_options = replace(self._plan_options, kernels=False if self._plan.scope is None else None,
                                         scope=self._plan.scope)
        # CUDA graphs are captured at the first step, from a copy of the graph specialised to
        # that batch's shapes (so no shape arithmetic is left for the CPU provider).
        self._want_graph = provider == "cuda" and cuda_graph is not False
        self._require_graph = bool(cuda_graph)
        self.cuda_graph = False
        self.cuda_graph_reason = "" if self._want_graph else (
            "cuda_graph=False" if provider == "cuda" else "CUDA graphs need the cuda provider")
        self._replay: _Replay | None = None
        if provider == "cuda":
            providers.check_cuda_session(self.session, self.model, allow_cpu_fallback=allow_cpu_fallback)
        self.track_scale = track_scale
        self._bind_outputs()
        self._keep: list[ort.OrtValue] = []
        self._lr_value: float | None = None
        self._lr_buf: ort.OrtValue | None = None
        self._set_state(initial)
        self._init_loop_state()

    def _init_loop_state(self) -> None:
        """What the training loop tracks between steps: counts, metrics, the data stream."""
        self.steps = 0
        self.metrics = Metrics()
        self._batches: Batches | None = None
        self._batches_source: Any = None
        self._pending_position: tuple[int, int] | None = None
        #: The data stream of the checkpoint loaded last (its ``data`` record and path), which
        #: the next ``fit`` on a dataset must continue.
        self._resumed: tuple[dict[str, Any], str] | None = None
        self._eval: tuple[ort.InferenceSession, str, list[str]] | None = None
        self._metrics_log = MetricsLog()
        #: The step of the last checkpoint written (``None``: none yet in this run).
        self.last_checkpoint_step: int | None = None

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

    def _prepare_graph(self, state: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """Set the fingerprint, default lr and session graph; return the initial state.

        The state's initial values move to the trainer's buffers; the session's copy of the
        graph has no initializers for them.
        """
        state_names = {a for a, _ in self.pairs}
        proto = as_proto(self.model)  # a copy: the session gets the graph without the state
        self.fingerprint = graph_fingerprint(proto)
        inits = self.model.graph.initializers
        missing = [a for a in state_names
                   if (a not in inits or inits[a].const_value is None) and (state is None or a not in state)]
        if missing:
            raise MpgraphError(f"state input(s) {', '.join(missing[:5])} have no initial value (initializer)")
        initial = {a: np.asarray(state[a]) if state is not None and a in state else inits[a].const_value.numpy()
                   for a, _ in self.pairs}
        lr = inits.get(_LR)
        self.default_lr = float(lr.const_value.numpy()) if lr is not None and lr.const_value is not None else None
        kept = [t for t in proto.graph.initializer if t.name not in state_names]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
        self._session_bytes = proto.SerializeToString()
        return initial

    def _bind_outputs(self) -> None:
        """Name the loss, ``found_inf`` and extra outputs, the data inputs, and the host
        buffers the plain session writes the loss and ``found_inf`` to."""
        props = self.model.metadata_props
        state_names = {a for a, _ in self.pairs}
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.loss_name = props.get(md.MODEL_LOSS) or ("loss" if "loss" in outputs else next(iter(outputs)))
        self.found_inf_name, self._scale_name = _loss_scale_state(props, set(outputs), state_names)
        self.has_loss_scale = self._scale_name is not None
        state_outs = {b for _, b in self.pairs}
        self._extra_outputs = [n for n in outputs if n not in state_outs and n not in (self.loss_name, self.found_inf_name)]
        self.data_inputs = _data_inputs(self.model, state_names)
        self._has_lr = any(v.name == _LR for v in self.model.graph.inputs)
        if self._want_graph and self._extra_outputs:
            # Outputs ORT allocates per run move between runs; a captured graph can't follow.
            self._graph_off(f"the graph has outputs beyond loss and state ({', '.join(self._extra_outputs[:3])})")
        # One per state set: a pipelined step's loss is read after the next step has run.
        self._loss_out = [self._out_buffer(outputs[self.loss_name], "cpu") for _ in range(self._ring)]
        self._found_out = [self._out_buffer(outputs[self.found_inf_name], "cpu") if self.found_inf_name else None
                           for _ in range(self._ring)]

    # -- buffers -------------------------------------------------------------------------

    def _new_session(self, graph: bool, shapes: Mapping[str, tuple[int, ...]] | None = None) -> ort.InferenceSession:
        """An ORT session of the step graph's plan (specialised to ``shapes`` when given);
        ``graph`` turns on CUDA graph capture."""
        self._plan: SessionPlan = plan_session(self._session_bytes, self.provider, replace(self._plan_options, shapes=shapes))
        #: Nodes the fused kernels replaced in the session's graph (0: kernels off).
        self.kernels_fused = self._plan.kernels_fused
        #: Scatter-adds and sums the session runs as Gemms (``deterministic=True`` on CUDA).
        self.deterministic_rewrites = self._plan.deterministic_rewrites
        return providers.new_session(self._plan.graph, self.provider, self.provider_options,
                               threads=self._threads, cuda_graph=graph, custom_ops=self._plan.custom_ops,
                               mem_pattern=self._mem_pattern if self._mem_pattern is not None else (False if graph else None),
                               deterministic=self._deterministic)

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

    def _set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Upload ``values`` into the current state buffers, allocating every set and
        prebinding each on first use. Later calls (a checkpoint load) overwrite the buffers in
        place, so captured CUDA graphs keep reading the same addresses."""
        arrays = {name: np.asarray(values[name]) for name, _ in self.pairs}
        current = self._sets[self._slot] if hasattr(self, "_sets") else None
        if current is not None and all(
            tuple(current[n].shape()) == a.shape and np.dtype(providers.ORT_TYPES.get(current[n].data_type(), object)) == a.dtype
            for n, a in arrays.items()
        ):
            for name, array in arrays.items():
                current[name].update_inplace(np.array(array, copy=True, order="C"))
            return
        self._sets: list[dict[str, ort.OrtValue]] = [{} for _ in range(self._ring)]
        for name, array in arrays.items():
            self._sets[0][name] = self._device_value(array)
            for spare in self._sets[1:]:
                spare[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                    list(array.shape), array.dtype, self.device, self.device_id)
        self._slot = 0
        self._bindings = self._ring_bindings(self.session, self._loss_out, self._found_out, self._lr_buf)
        self._replay = None  # new addresses: capture again at the next step

    @property
    def _state(self) -> dict[str, ort.OrtValue]:
        """The state set the next step reads."""
        return self._sets[self._slot]

    def _settled(self) -> tuple[dict[str, ort.OrtValue], int]:
        """The state and step count after the last finished step (pipelined steps may be in
        flight: the oldest one still reads the state its predecessor left)."""
        if self._inflight:
            return self._sets[self._inflight[0].slot], self._inflight[0].step - 1
        return self._state, self.steps

    def _advance(self, steps: int) -> None:
        """Move along the ring of state sets (negative: undo steps whose sets are intact)."""
        self._slot = (self._slot + steps) % len(self._sets)
        self.steps += steps
        if steps < 0:
            self.metrics.truncate(self.steps)

    def _ring_bindings(self, session: ort.InferenceSession, loss: list[ort.OrtValue],
                       found: list[ort.OrtValue | None], lr: ort.OrtValue | None) -> list[ort.IOBinding]:
        """One binding per state set: ``[s]`` reads set s, writes the next set in the ring and
        ``loss[s]``/``found[s]``."""
        n = len(self._sets)
        return [self._make_binding(session, self._sets[s], self._sets[(s + 1) % n], loss[s], found[s], lr)
                for s in range(n)]

    def _make_binding(self, session: ort.InferenceSession, read: Mapping[str, ort.OrtValue],
                      write: Mapping[str, ort.OrtValue], loss: ort.OrtValue, found: ort.OrtValue | None,
                      lr: ort.OrtValue | None) -> ort.IOBinding:
        binding = session.io_binding()
        for name, out in self.pairs:
            binding.bind_ortvalue_input(name, read[name])
            binding.bind_ortvalue_output(out, write[name])
        binding.bind_ortvalue_output(self.loss_name, loss)
        if self.found_inf_name is not None and found is not None:
            binding.bind_ortvalue_output(self.found_inf_name, found)
        for name in self._extra_outputs:
            binding.bind_output(name, self.device, self.device_id)
        if lr is not None:
            binding.bind_ortvalue_input(_LR, lr)
        return binding

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Current state values (host copies), by state input name."""
        state, _ = self._settled()
        return {name: state[name].numpy().copy() for name, _ in self.pairs}

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` without loss scaling."""
        return self._scale_in(self._settled()[0])

    def _scale_in(self, state: Mapping[str, ort.OrtValue]) -> float | None:
        """The loss scale held in one of the state buffer sets (``None``: no scaling)."""
        return float(state[self._scale_name].numpy().reshape(-1)[0]) if self._scale_name is not None else None

    @staticmethod
    def _read_outputs(loss_buf: ort.OrtValue, found_buf: ort.OrtValue | None) -> tuple[float, bool]:
        """A finished step's loss and whether the graph skipped it (``found_inf``)."""
        loss = float(loss_buf.numpy().reshape(-1)[0])
        return loss, bool(found_buf.numpy().reshape(-1)[0]) if found_buf is not None else False

    # -- CUDA graphs ---------------------------------------------------------------------

    def _graph_off(self, reason: str) -> None:
        if self._require_graph:
            raise MpgraphError(f"cannot run the step as a CUDA graph: {reason}")
        self._want_graph, self.cuda_graph, self.cuda_graph_reason = False, False, reason
        logger.warning("CUDA graph capture is off: %s", reason)

    @staticmethod
    def _signature(batch: Mapping[str, np.ndarray], names: Iterable[str]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {n: (np.shape(batch[n]), np.asarray(batch[n]).dtype) for n in names}

    def _start_replay(self, batch: Mapping[str, np.ndarray]) -> None:
        """Build the capturing session for ``batch``'s shapes and its fixed buffers."""
        names = [spec.name for spec in self.data_inputs]
        signature = self._signature(batch, names)
        try:
            session = self._new_session(graph=True, shapes={n: shape for n, (shape, _) in signature.items()})
        except MpgraphError as e:
            self._graph_off(str(e))
            return
        outputs = {o.name: o for o in session.get_outputs()}
        ring = range(len(self._sets))
        loss = [self._out_buffer(outputs[self.loss_name], self.device) for _ in ring]
        found = [self._out_buffer(outputs[self.found_inf_name], self.device) if self.found_inf_name else None
                 for _ in ring]
        lr = None
        if self._lr_value is not None:
            lr = ort.OrtValue.ortvalue_from_numpy(np.asarray(self._lr_value, np.float32), self.device, self.device_id)
        bufs = [{n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(batch[n]), self.device, self.device_id)
                 for n in names} for _ in ring]
        bindings = self._ring_bindings(session, loss, found, lr)
        for binding, set_bufs in zip(bindings, bufs):
            for n, buf in set_bufs.items():
                binding.bind_ortvalue_input(n, buf)
        options = []
        for s in ring:
            pair = (ort.RunOptions(), ort.RunOptions())
            for o in pair:  # graph ids from 1: one captured graph per state set (0 is ORT's default)
                o.add_run_config_entry("gpu_graph_id", str(1 + s))
            pair[1].add_run_config_entry("disable_synchronize_execution_providers", "1")
            options.append(pair)
        self._replay = _Replay(session, bindings, bufs, signature, loss, found, lr, options)
        self.cuda_graph, self.cuda_graph_reason = True, ""

    # -- stepping ------------------------------------------------------------------------

    def _bind_lr(self, lr: float | None) -> None:
        if not self._has_lr:
            if lr is not None:
                raise MpgraphError("this step graph has no 'lr' input (built without an optimizer?)")
            return
        if lr is not None and not math.isfinite(lr):
            raise UsageError(f"learning rate must be finite, got {lr}")
        # None keeps the lr in use: the one a resumed checkpoint carries, else the graph's.
        value = lr if lr is not None else (self._lr_value if self._lr_value is not None else self.default_lr)
        if value is None or value == self._lr_value:
            return
        array = np.asarray(value, dtype=np.float32)
        self._lr_value = value
        self._lr_buf = ort.OrtValue.ortvalue_from_numpy(array)
        for binding in self._bindings:
            binding.bind_ortvalue_input(_LR, self._lr_buf)
        if self._replay is not None:
            if self._replay.lr is None:
                self._replay = None  # captured without an lr binding: capture again
            else:
                self._replay.lr.update_inplace(array)  # same address: the captured graphs read it

    def _check_inputs(self, batch: Mapping[str, np.ndarray]) -> None:
        for spec in self.data_inputs:
            if spec.name not in batch:
                raise MpgraphError(f"batch has no array for input '{spec.name}' (got {', '.join(batch)})")

    def step(self, batch: Mapping[str, np.ndarray], lr: float | None = None) -> StepResult:
        """Run one training step on ``batch`` (data input name -> array).

        Args:
            batch: Arrays for every data input (``x``, ``label``, ...).
            lr: Learning rate (``None``: the one in use, i.e. a resumed checkpoint's, else the
                graph's default).
        """
        self._bind_lr(lr)
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
        self._bind_lr(lr)
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

    def _launch(self, batch: Mapping[str, np.ndarray], position: tuple[int, int] | None = None) -> _Launched:
        """Run one step on ``batch`` (on a pipelined trainer's captured graphs, enqueue it) and
        move to the state set it writes; ``_finish`` reads its result."""
        start, slot = time.perf_counter(), self._slot
        if self._want_graph and self._replay is None:
            self._start_replay(batch)
        replay = self._replay
        launched = None
        if replay is not None and self._signature(batch, replay.batch[0]) == replay.signature:
            launched = self._launch_replay(replay, batch, slot)
        if launched is None:
            binding = self._bindings[slot]
            # The binding points into these arrays' memory: hold them until the next step.
            self._keep = []
            for spec in self.data_inputs:
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(batch[spec.name]))
                self._keep.append(value)
                binding.bind_ortvalue_input(spec.name, value)
            self.session.run_with_iobinding(binding)
            launched = _Launched(slot, batch, self._loss_out[slot], self._found_out[slot])
        self._advance(1)
        launched.start, launched.step, launched.position = start, self.steps, position
        return launched

    def _launch_replay(self, replay: _Replay, batch: Mapping[str, np.ndarray], slot: int) -> _Launched | None:
        """Run the captured graph that reads state set ``slot`` (``None``: capture failed, and
        CUDA graphs are off from now on)."""
        for name, buf in replay.batch[slot].items():  # its last reader ran a full ring ago
            buf.update_inplace(np.ascontiguousarray(batch[name]))
        nosync = self.pipeline and replay.runs >= _SYNC_RUNS_PER_GRAPH * len(replay.bindings)
        try:
            replay.session.run_with_iobinding(replay.bindings[slot], replay.options[slot][nosync])
        except Exception as e:  # noqa: BLE001 - ORT raises RuntimeError/Fail types
            if nosync:  # captured already: a real failure
                raise
            # A kernel that refuses capture (e.g. Concat over 32 inputs) fails here, before
            # any state input is touched: the step runs again without graphs.
            self._replay = None
            self._graph_off(f"capture failed: {str(e).splitlines()[0][:300]}")
            return None
        replay.runs += 1
        event = self._events.record() if nosync and self._events is not None else None
        return _Launched(slot, batch, replay.loss[slot], replay.found[slot], event)

    def _finish(self, launched: _Launched) -> StepResult:
        """Wait for a launched step (its own event only) and record its result."""
        if launched.event is not None:
            launched.event.synchronize()
        loss, skipped = self._read_outputs(launched.loss, launched.found)
        # The set it read is intact: the step after it (if launched) writes another one.
        scale = self._scale_in(self._sets[launched.slot]) if self.has_loss_scale and self.track_scale else None
        result = StepResult(loss, scale, skipped, time.perf_counter() - launched.start)
        self.metrics.append(launched.step, result)
        return result

    def _settle(self, launched: _Launched | None, mode: str, report: Callable[[StepResult], None]) -> None:
        """Add ``launched`` to the steps in flight, then finish and report every one but the
        newest (pipelined) or all of them (otherwise, or ``launched=None``: drain).

        A finished step whose loss is not finite and was not skipped by the graph is undone
        unless ``mode`` is ``ignore``, with the step launched after it, which is then run
        again from the restored state: the same outcome as without pipelining.
        """
        if launched is not None:
            self._inflight.append(launched)
        keep = 1 if self.pipeline and launched is not None else 0
        while len(self._inflight) > keep:
            result = self._finish(self._inflight[0])
            self._inflight.pop(0)
            if not self._undoes(result, mode):
                report(result)
                continue
            after, self._inflight = self._inflight, []
            self._wait(after)  # they read the bad step's state: they go too
            self._advance(-1 - len(after))
            report(self._refuse(f"step {self.steps + 1}: the loss is {result.loss} (the update was undone)", mode))
            for step in after:
                self._settle(self._launch(step.batch, step.position), mode, report)

    def _abandon(self, mode: str) -> None:
        """After an exception: finish the steps in flight, keeping those that ended well."""
        while self._inflight:
            result = self._finish(self._inflight[0])
            self._inflight.pop(0)
            if self._undoes(result, mode):
                self._wait(self._inflight)
                self._advance(-1 - len(self._inflight))
                self._inflight = []

    @staticmethod
    def _undoes(result: StepResult, mode: str) -> bool:
        """``fit`` undoes this finished step: its loss is not finite, the graph did not skip it,
        and ``on_nonfinite`` is not ``ignore``."""
        return mode != "ignore" and not result.skipped and not math.isfinite(result.loss)

    @staticmethod
    def _wait(steps: list[_Launched]) -> None:
        """Wait for launched steps without reading their results."""
        for step in steps:
            if step.event is not None:
                step.event.synchronize()

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
        if isinstance(data, (Dataset, Mapping)):
            it = self._batches_for(data, batch_size, seed)
        else:
            it = iter(data)
        self.stop_reason = ""
        self._bind_lr(lr)
        report = _FitReport(self, steps, callback, progress)
        # The data position after each counted step's batch: an exception puts the stream back
        # to the one after the last step that counts.
        marks = {self.steps: it.position} if isinstance(it, Batches) else None
        try:
            for _ in range(steps):
                if stop is not None and stop():
                    self.stop_reason = getattr(stop, "name", "") or "stop requested"
                    break
                before = it.position if isinstance(it, Batches) else None
                try:
                    batch = next(it)
                except StopIteration:
                    break
                problem = None if on_nonfinite == "ignore" else _nonfinite_arrays(batch)
                if problem is not None:
                    self._settle(None, on_nonfinite, report)  # the steps in flight come first
                    if marks is not None:
                        marks[self.steps + 1] = it.position
                    report(self._refuse(f"step {self.steps + 1}: the batch has {problem}", on_nonfinite))
                    continue
                self._check_inputs(batch)
                launched = self._launch(batch, before)
                if marks is not None:
                    marks[self.steps] = it.position
                self._settle(launched, on_nonfinite, report)
            self._settle(None, on_nonfinite, report)
        except BaseException:
            self._abandon(on_nonfinite)
            if marks is not None and self.steps in marks:
                it.seek(marks[self.steps])  # type: ignore[attr-defined]
            raise
        return self.metrics

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

    # -- data checks ---------------------------------------------------------------------

    def label_bounds(self) -> dict[str, tuple[int, int | None]]:
        """Data inputs that are class labels of a loss op, with (classes, ignore_index).

        The label may reach the loss through shape-only ops (``Reshape``, ``Flatten``, ...). The
        class count is the loss's score input's dimension 1 when it is static
        (``SoftmaxCrossEntropyLoss``/``NegativeLogLikelihoodLoss`` take ``[N, C, ...]``).
        """
        passthrough = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast")
        origin = {s.name: s.name for s in self.data_inputs if s.dtype.kind in "iu"}
        out: dict[str, tuple[int, int | None]] = {}
        for node in self.model.graph:  # topological order: a label's reshapes come first
            first = node.inputs[0] if node.inputs else None
            if node.op_type in passthrough and first is not None and first.name in origin:
                for o in node.outputs:
                    origin[o.name or ""] = origin[first.name]
                continue
            if node.op_type not in providers.LOSS_OPS or len(node.inputs) < 2:
                continue
            scores, labels = node.inputs[0], node.inputs[1]
            if labels is None or labels.name not in origin or scores is None or scores.shape is None:
                continue
            if len(scores.shape) < 2 or not isinstance(scores.shape[1], int):
                continue
            attr = node.attributes.get("ignore_index")
            out[origin[labels.name]] = (int(scores.shape[1]), int(attr.as_int()) if attr is not None else None)
        return out

    def vocab(self, token_input: str) -> int | None:
        """Rows of the embedding table a token input indexes (a Gather on it), if any."""
        for node in self.model.graph:
            table = node.inputs[0] if node.inputs else None
            if node.op_type == "Gather" and len(node.inputs) > 1 and node.inputs[1] is not None \
                    and node.inputs[1].name == token_input and table is not None \
                    and table.shape is not None and isinstance(table.shape[0], int):
                return int(table.shape[0])
        return None

    def load_data(self, name: str | os.PathLike[str], *, seed: int = 0) -> Dataset:
        """The dataset ``name`` (``digits``, ``sequence`` or a ``.npz``) fitted to this graph.

        A token input's vocabulary is the embedding table's row count, and the labels of
        both splits are checked against the loss's class count (``label_bounds``).

        Raises:
            DataError: Unknown dataset, arrays that do not fit the inputs, or labels out of range.
        """
        tok = token_input(self.data_inputs)
        vocab = self.vocab(tok.name) if tok is not None else None
        dataset = dataset_for_model(name, self.data_inputs, seed=seed, vocab=vocab)
        bounds = self.label_bounds()
        check_labels(dataset.train, bounds, f"dataset '{name}'")
        check_labels(dataset.test, bounds, f"dataset '{name}' (test split)")
        return dataset

    # -- checkpoints ---------------------------------------------------------------------

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
        meta = {
            "fingerprint": self.fingerprint,
            "steps": steps,
            "names": [name for name, _ in self.pairs],
            "data": data,
            "lr": self._lr_value,
        }
        arrays = [state[name].numpy() for name, _ in self.pairs]
        write_checkpoint(path, meta, arrays, self.metrics, self._metrics_log, self.last_checkpoint_step)
        self.last_checkpoint_step = steps

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by ``save_checkpoint`` for this same graph.

        Metadata is checked key by key (type and range) before anything is restored; the
        metrics history comes from ``metrics_path(path)`` (or, for a format-1 checkpoint, from
        the checkpoint itself).

        Raises:
            CheckpointError: Missing/unreadable file, bad metadata (naming the key), a state
                array of another shape or dtype, or a checkpoint of a different graph.
        """
        want = {name: (self._state[name].shape(), providers.ORT_TYPES.get(self._state[name].data_type()))
                for name, _ in self.pairs}
        meta, arrays, self.metrics = read_checkpoint(path, self.fingerprint, want)
        self._set_state(arrays)
        self.steps = meta["steps"]
        self._metrics_log = MetricsLog()
        self.last_checkpoint_step = self.steps
        data = meta.get("data")
        self._batches = None
        self._pending_position = (data["epoch"], data["index"]) if data else None
        self._resumed = (dict(data), str(path)) if data else None
        self._lr_value = None
        self._lr_buf = None
        if meta.get("lr") is not None:
            self._bind_lr(meta["lr"])

    # -- inspection ----------------------------------------------------------------------

    def node_providers(self) -> dict[str, str]:
        """Node name -> execution provider ORT assigned it (empty if this ORT cannot say)."""
        return providers.node_providers(self.session)

    # -- evaluation ----------------------------------------------------------------------

    def _eval_session(self) -> tuple[ort.InferenceSession, str, list[str]]:
        if self._eval is None:
            forward = providers.forward_model(self._session_bytes, providers.logits_name(self.model))
            session = providers.eval_session(forward, self.session.get_providers())
            self._eval = (session, forward.graph.outputs[0].name or "", [v.name or "" for v in forward.graph.inputs])
        return self._eval

    def predict(self, arrays: Mapping[str, np.ndarray], batch_size: int = 512) -> np.ndarray:
        """Logits of the forward model on ``arrays`` with the current parameters."""
        session, out_name, inputs = self._eval_session()
        state_names = {a for a, _ in self.pairs}
        settled, _ = self._settled()
        n = len(next(iter(arrays.values())))
        parts = []
        for start in range(0, n, batch_size):
            binding = session.io_binding()
            keep = []
            for name in inputs:
                if name in state_names:
                    binding.bind_ortvalue_input(name, settled[name])
                else:
                    if name not in arrays:
                        raise MpgraphError(f"evaluation data has no array for input '{name}'")
                    keep.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arrays[name][start:start + batch_size])))
                    binding.bind_ortvalue_input(name, keep[-1])
            binding.bind_output(out_name, "cpu")
            session.run_with_iobinding(binding)
            parts.append(binding.get_outputs()[0].numpy())
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)

    def evaluate(self, arrays: Mapping[str, np.ndarray], *, label: str = "label", batch_size: int = 512) -> dict[str, float]:
        """Classification accuracy of the current parameters on ``arrays`` (e.g. a test split).

        Logits ``[..., C]`` are compared with integer labels position by position (a language
        model's ``[N*T, C]`` logits with ``[N, T]`` labels work too). A training-mode
        BatchNormalization in the step graph normalises with batch statistics here as well.
        """
        if label not in arrays or np.asarray(arrays[label]).dtype.kind not in "iu":
            raise MpgraphError(f"cannot evaluate accuracy: no integer '{label}' array")
        logits = self.predict(arrays, batch_size)
        labels = np.asarray(arrays[label]).reshape(-1)
        pred = logits.reshape(-1, logits.shape[-1]).argmax(-1)
        if pred.shape != labels.shape:
            raise MpgraphError(f"cannot evaluate: {pred.size} predictions for {labels.size} labels")
        return {"accuracy": float((pred == labels).mean()), "samples": float(labels.size)}


def run_training(
    trainer: Trainer,
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
