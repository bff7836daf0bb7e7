"""Train a step graph on ONNX Runtime (CPU or CUDA) with state resident on the device.

A ``Trainer`` owns one ORT session of a training step graph (``build_training_graph``,
optionally converted by ``mpgraph.convert``). Every state input of ``MODEL_STATE_PAIRS``
(parameters, optimizer moments, step counter, running statistics and, with loss scaling,
``loss_scale`` and its growth tracker) lives in an ``OrtValue`` on the provider's device.
Two buffer sets and two prebuilt ``IOBinding`` objects alternate: binding A reads set 1 and
writes set 2, binding B the reverse. A step binds only the batch, runs, and copies back the
loss (and ``found_inf``/the loss scale when the graph has them), nothing else.

Rules the trainer enforces before the first step:

1. The provider must be available in this ORT build (``cuda`` needs onnxruntime-gpu).
2. A native float16/bfloat16 lowering (``mpgraph.dtype`` set, ``mpgraph.emulated`` not
   ``true``) does not run on the CPU provider; convert with ``--emulate`` for CPU.
3. On CUDA, session-level fallback is disabled (a CUDA failure is an error, not a silent CPU
   session), and no float-producing node may be assigned to the CPU provider unless
   ``allow_cpu_fallback=True``. Integer/bool shape arithmetic that ORT places on CPU on
   purpose is allowed. ``node_providers()`` returns the assignment.

Checkpoints (``save_checkpoint``) hold every state buffer, the step count, the data stream
position, the metrics so far and a fingerprint of the graph (inputs, outputs and nodes,
initializer values excluded); ``load_checkpoint`` refuses one from another graph, and
continuing after it reproduces the uninterrupted run bit for bit on CPU.

Accuracy (``evaluate``): the forward part of the step graph is cut out (from the data
inputs and parameters to the value named ``logits``, or else the first input of the loss op)
into an inference session on the same provider, whose parameter inputs are bound to the
trainer's state buffers, so evaluation copies no weights.

Example:
    >>> from mpgraph.training import build_training_graph
    >>> from mpgraph.data import load_dataset
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx")  # doctest: +SKIP
    >>> trainer = Trainer(step, provider="cpu")  # doctest: +SKIP
    >>> metrics = trainer.fit(dataset, steps=100, lr=1e-3)  # doctest: +SKIP
    >>> trainer.save_checkpoint("run.ckpt.npz")  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mpgraph._ir import meta as md
from mpgraph import targets
from mpgraph.data import Batches, Dataset, InputSpec
from mpgraph.errors import CheckpointError, MpgraphError, OutputError, TrainingError, UsageError
from mpgraph.io import write_atomic

__all__ = [
    "Trainer",
    "StepResult",
    "Metrics",
    "plot_losses",
    "graph_fingerprint",
    "metrics_path",
    "stop_on_signals",
    "StopRequest",
    "NONFINITE_MODES",
    "COLLAPSE_SKIPS",
    "PROVIDERS",
]

logger = logging.getLogger(__name__)

#: Short provider names -> ORT execution providers.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
_LR = "lr"
_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_CHECKPOINT_FORMAT = 2  # 2: metrics history in its own file (1 embedded it; still read)
#: ``fit(on_nonfinite=...)``: what a non-finite batch or loss does.
NONFINITE_MODES = ("stop", "skip", "ignore")
#: Consecutive skipped steps after which the loss scale counts as collapsed (a warning).
COLLAPSE_SKIPS = 20
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
    "tensor(uint8)": np.uint8, "tensor(int8)": np.int8,
}


@dataclass(frozen=True)
class StepResult:
    """What one step reports.

    Attributes:
        loss: The step's loss (float32 graph output, as a Python float).
        loss_scale: The loss scale this step used (``None`` without loss scaling).
        skipped: True when the graph found inf/NaN gradients and skipped the update.
        seconds: Wall time of the step (binding, run, reading the loss).
    """

    loss: float
    loss_scale: float | None
    skipped: bool
    seconds: float


@dataclass
class Metrics:
    """Per-step records of a run: ``step`` (1-based), ``loss``, ``loss_scale``, ``skipped``,
    ``seconds``. Written as CSV or JSON; ``plot_losses`` draws several runs."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    loss_scale: list[float | None] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def append(self, step: int, result: StepResult) -> None:
        self.step.append(step)
        self.loss.append(result.loss)
        self.loss_scale.append(result.loss_scale)
        self.skipped.append(result.skipped)
        self.seconds.append(result.seconds)

    def __len__(self) -> int:
        return len(self.step)

    def to_dict(self) -> dict[str, list[Any]]:
        """Columns as lists; non-finite floats become ``None`` (valid JSON)."""

        def clean(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else x

        return {
            "step": list(self.step),
            "loss": [clean(x) for x in self.loss],
            "loss_scale": [clean(x) for x in self.loss_scale],
            "skipped": list(self.skipped),
            "seconds": list(self.seconds),
        }

    def rows(self, start: int = 0) -> list[dict[str, Any]]:
        """Records ``start:`` as JSON-ready dicts (non-finite floats as ``None``)."""
        d = self.to_dict()
        return [{k: d[k][i] for k in d} for i in range(start, len(self))]

    def truncate(self, steps: int) -> None:
        """Keep only the records of steps ``<= steps``."""
        keep = [i for i, s in enumerate(self.step) if s <= steps]
        for name in ("step", "loss", "loss_scale", "skipped", "seconds"):
            column = getattr(self, name)
            setattr(self, name, [column[i] for i in keep])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Metrics:
        return cls(
            [int(s) for s in d["step"]],
            [math.nan if x is None else float(x) for x in d["loss"]],
            [None if x is None else float(x) for x in d["loss_scale"]],
            [bool(x) for x in d["skipped"]],
            [float(x) for x in d["seconds"]],
        )

    def summary(self) -> dict[str, Any]:
        """Steps, first/last loss, skipped steps, final scale, median steps per second.

        A non-finite loss or scale reads ``None`` (so the JSON stays valid); ``nonfinite_losses``
        counts them.
        """
        secs = sorted(self.seconds)

        def clean(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else x

        return {
            "steps": len(self),
            "first_loss": clean(self.loss[0]) if self.loss else None,
            "last_loss": clean(self.loss[-1]) if self.loss else None,
            "nonfinite_losses": sum(not math.isfinite(x) for x in self.loss),
            "skipped": int(sum(self.skipped)),
            "loss_scale": clean(self.loss_scale[-1]) if self.loss_scale else None,
            "steps_per_s": 1.0 / secs[len(secs) // 2] if secs and secs[len(secs) // 2] > 0 else None,
        }

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write ``step,loss,loss_scale,skipped,seconds`` rows (atomically)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["step", "loss", "loss_scale", "skipped", "seconds"])
        for row in zip(self.step, self.loss, self.loss_scale, self.skipped, self.seconds):
            s, loss, scale, skipped, secs = row
            w.writerow([s, repr(loss), "" if scale is None else repr(scale), int(skipped), f"{secs:.6g}"])
        _write_atomic(path, buf.getvalue().encode())

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write ``{"summary": ..., "metrics": {column: [...]}}`` (atomically)."""
        doc = {"summary": self.summary(), "metrics": self.to_dict()}  # summary() and to_dict() drop NaN
        _write_atomic(path, (json.dumps(doc, allow_nan=False) + "\n").encode())


_write_atomic = write_atomic


def graph_fingerprint(model: ir.Model | onnx.ModelProto) -> str:
    """SHA-256 of a graph's interface and nodes, ignoring initializer values, docs and metadata.

    Two step graphs share a fingerprint when their inputs, outputs (names, types, shapes),
    opsets and nodes (op, domain, inputs, outputs, attributes) are equal, so a checkpoint
    taken on one can be resumed on the other.
    """
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    h = hashlib.sha256()
    for op in sorted((o.domain, o.version) for o in proto.opset_import):
        h.update(repr(op).encode())
    for group in (proto.graph.input, proto.graph.output):
        for v in group:
            h.update(v.name.encode() + b"\0" + v.type.SerializeToString(deterministic=True))
        h.update(b"\1")
    for node in proto.graph.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.ClearField("doc_string")
        n.ClearField("metadata_props")
        h.update(n.SerializeToString(deterministic=True))
    return h.hexdigest()[:32]


def metrics_path(checkpoint: str | os.PathLike[str]) -> Path:
    """The metrics history file of a checkpoint: ``run.ckpt.npz`` -> ``run.ckpt.metrics.jsonl``.

    One JSON record per line (``step``, ``loss``, ``loss_scale``, ``skipped``, ``seconds``),
    appended at every checkpoint, so checkpoints stay the size of the state however long the
    run; a resume keeps the records up to the checkpoint's step.
    """
    p = Path(checkpoint)
    return p.with_name(p.name.removesuffix(".npz") + ".metrics.jsonl")


def _read_metrics_file(path: Path, steps: int) -> Metrics | None:
    """Records of steps ``<= steps`` from a metrics history file (a torn last line is ignored)."""
    if not path.is_file():
        return None
    rows: dict[int, dict[str, Any]] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if 0 < step <= steps:
            rows[step] = row
    ordered = [rows[k] for k in sorted(rows)]
    try:
        return Metrics.from_dict({k: [r.get(k) for r in ordered] for k in ("step", "loss", "loss_scale", "skipped", "seconds")})
    except (TypeError, ValueError):
        return None


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


def _load(model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike[str]) -> ir.Model:
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model)
    if isinstance(model, bytes):
        return ir.from_proto(onnx.load_from_string(model))
    from mpgraph.io import load_model

    return load_model(model)


def _nonfinite_arrays(batch: Mapping[str, np.ndarray]) -> str | None:
    """``"N non-finite values in 'x'"`` for the first float array with NaN/inf, else ``None``."""
    for name, a in batch.items():
        a = np.asarray(a)
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            return f"{int((~np.isfinite(a)).sum())} non-finite value(s) (NaN or inf) in '{name}'"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_meta(meta: Any, p: Path) -> dict[str, Any]:
    """Checkpoint metadata with every key present and of the right type, else one line."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: checkpoint metadata is not a JSON object")
    fmt = meta.get("format")
    if fmt not in (1, _CHECKPOINT_FORMAT):
        raise CheckpointError(f"{p}: checkpoint format {fmt!r} is not {_CHECKPOINT_FORMAT}")
    for key, ok, what in (("fingerprint", lambda v: isinstance(v, str), "a string"),
                          ("steps", lambda v: _is_int(v) and v >= 0, "a step count >= 0"),
                          ("names", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                           "a list of state names")):
        if key not in meta:
            raise CheckpointError(f"{p}: checkpoint metadata has no '{key}' ({what})")
        if not ok(meta[key]):
            raise CheckpointError(f"{p}: checkpoint metadata '{key}' should be {what}, got {str(meta[key])[:60]!r}")
    data = meta.get("data")
    if data is not None and not (isinstance(data, dict) and all(_is_int(data.get(k)) and data[k] >= 0
                                                               for k in ("epoch", "index"))):
        raise CheckpointError(f"{p}: checkpoint metadata 'data' should hold integers epoch and index >= 0, "
                              f"got {str(data)[:80]!r}")
    lr = meta.get("lr")
    if lr is not None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise CheckpointError(f"{p}: checkpoint metadata 'lr' should be a finite number >= 0, got {str(lr)[:40]!r}")
        meta["lr"] = float(lr)
    return meta


@dataclass
class _Replay:
    """A session with CUDA graph capture, specialised to one batch signature, and the fixed
    device buffers its captured graphs read and write (addresses never change)."""

    session: ort.InferenceSession
    bindings: list[ort.IOBinding]  # indexed by parity: bindings[p] reads the current state set
    batch: dict[str, ort.OrtValue]
    signature: dict[str, tuple[tuple[int, ...], np.dtype]]
    loss: ort.OrtValue
    found: ort.OrtValue | None
    lr: ort.OrtValue | None


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

    Raises:
        MpgraphError: Not a step graph, provider unavailable, a native low-precision graph on
            CPU, or (CUDA) float nodes falling back to CPU.
    """

    def __init__(
        self,
        model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike[str],
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
    ) -> None:
        self.model = _load(model)
        props = self.model.metadata_props
        raw = props.get(md.MODEL_STATE_PAIRS)
        if raw is None:
            raise MpgraphError("not a training step graph (no mpgraph.state_pairs metadata); build one with `mpgraph train-graph`")
        self.pairs: list[tuple[str, str]] = [(a, b) for a, b in json.loads(raw)]
        if provider not in PROVIDERS:
            raise MpgraphError(f"unknown provider '{provider}'; valid: {', '.join(PROVIDERS)}")
        ep = PROVIDERS[provider]
        if ep not in ort.get_available_providers():
            raise MpgraphError(
                f"provider '{provider}' ({ep}) is not available in this onnxruntime build "
                f"(available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu for cuda"
            )
        dtype = props.get(md.MODEL_DTYPE)
        if provider == "cpu" and dtype in ("float16", "bfloat16") and props.get(md.MODEL_EMULATED) != "true":
            raise MpgraphError(
                f"this graph is a native {dtype} lowering, which ORT's CPU provider cannot run "
                f"(no {dtype} compute kernels); convert the fp32 step graph with --emulate for CPU, or use --provider cuda"
            )
        self.provider = provider
        #: Notes about running this graph on ``provider`` (``mpgraph.targets.check_runnable``,
        #: which refuses a graph converted for a target whose kernels ``provider`` lacks).
        self.notes: list[str] = targets.check_runnable(self.model, provider)
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.device_id = device_id if provider == "cuda" else 0
        self.fingerprint = graph_fingerprint(self.model)

        state_names = {a for a, _ in self.pairs}
        proto = ir.to_proto(self.model)
        inits = {t.name: t for t in proto.graph.initializer}
        missing = [a for a in state_names if a not in inits and (state is None or a not in state)]
        if missing:
            raise MpgraphError(f"state input(s) {', '.join(missing[:5])} have no initial value (initializer)")
        initial = {a: (np.asarray(state[a]) if state is not None and a in state else onnx.numpy_helper.to_array(inits[a]))
                   for a, _ in self.pairs}
        lr_init = inits.get(_LR)
        self.default_lr = float(onnx.numpy_helper.to_array(lr_init)) if lr_init is not None else None
        # State initial values live in the trainer's buffers; the session gets no copy.
        kept = [t for t in proto.graph.initializer if t.name not in state_names]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)

        self.tf32 = (props.get(md.MODEL_TF32) == "true") if tf32 is None else bool(tf32)
        ep_options: dict[str, str] = {}
        if provider == "cuda":
            ep_options = {"device_id": str(device_id), "use_tf32": "1" if self.tf32 else "0"}
        ep_options.update({str(k): str(v) for k, v in (provider_options or {}).items()})
        self.provider_options = ep_options
        self._session_bytes = proto.SerializeToString()
        self._threads = threads
        self.session = self._new_session(graph=False)
        # CUDA graphs are captured at the first step, from a copy of the graph specialised to
        # that batch's shapes (so no shape arithmetic is left for the CPU provider).
        self._want_graph = provider == "cuda" and cuda_graph is not False
        self._require_graph = bool(cuda_graph)
        self.cuda_graph = False
        self.cuda_graph_reason = "" if self._want_graph else (
            "cuda_graph=False" if provider == "cuda" else "CUDA graphs need the cuda provider")
        self._replay: _Replay | None = None
        if provider == "cuda":
            self.session.disable_fallback()
            if ep not in self.session.get_providers():
                raise MpgraphError(f"onnxruntime did not start {ep} for this graph")
            self._check_fallback(allow_cpu_fallback)
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.loss_name = props.get(md.MODEL_LOSS) or ("loss" if "loss" in outputs else next(iter(outputs)))
        self.found_inf_name = md.FOUND_INF if md.FOUND_INF in outputs else None
        self.has_loss_scale = md.LOSS_SCALE in state_names
        self.track_scale = track_scale
        state_outs = {b for _, b in self.pairs}
        self._extra_outputs = [n for n in outputs if n not in state_outs and n not in (self.loss_name, self.found_inf_name)]
        graph_inputs = {v.name or "": v for v in self.model.graph.inputs}
        self.data_inputs = [
            InputSpec(name, np.dtype(v.dtype.numpy() if v.dtype is not None else np.float32),
                      tuple(d if isinstance(d, int) else str(d) for d in v.shape) if v.shape is not None else None)
            for name, v in graph_inputs.items() if name and name not in state_names and name != _LR
        ]
        self._has_lr = _LR in graph_inputs
        if self._want_graph and self._extra_outputs:
            # Outputs ORT allocates per run move between runs; a captured graph can't follow.
            self._graph_off(f"the graph has outputs beyond loss and state ({', '.join(self._extra_outputs[:3])})")
        self._loss_out = self._out_buffer(outputs[self.loss_name], "cpu")
        self._found_out = self._out_buffer(outputs[self.found_inf_name], "cpu") if self.found_inf_name else None
        self._keep: list[ort.OrtValue] = []
        self._lr_value: float | None = None
        self._lr_buf: ort.OrtValue | None = None
        self._set_state(initial)
        self.steps = 0
        self.metrics = Metrics()
        self._batches: Batches | None = None
        self._batches_source: Any = None
        self._pending_position: tuple[int, int] | None = None
        self._eval: tuple[ort.InferenceSession, str, list[str]] | None = None
        self._metrics_written: dict[Path, int] = {}
        #: The step of the last checkpoint written (``None``: none yet in this run).
        self.last_checkpoint_step: int | None = None

    # -- buffers -------------------------------------------------------------------------

    def _new_session(self, graph: bool, model: bytes | None = None) -> ort.InferenceSession:
        """An ORT session of the step graph; ``graph`` turns on CUDA graph capture."""
        options = ort.SessionOptions()
        # Fatal only: warnings would be one "Initializer X appears in graph inputs" per state
        # tensor, and a failing node's error log repeats the exception the caller reports.
        options.log_severity_level = 4
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        if self._threads is not None:
            options.intra_op_num_threads = self._threads
        ep = PROVIDERS[self.provider]
        ep_options = dict(self.provider_options)
        if graph and self.provider == "cuda":
            ep_options["enable_cuda_graph"] = "1"
        providers: list[Any] = [(ep, ep_options)] + (["CPUExecutionProvider"] if self.provider == "cuda" else [])
        try:
            return ort.InferenceSession(model or self._session_bytes, options, providers=providers)
        except Exception as e:  # noqa: BLE001 - ORT raises its own Fail/InvalidGraph types
            what = " with CUDA graph capture" if graph else ""
            raise MpgraphError(f"onnxruntime cannot load the step graph on {self.provider}{what}: {str(e).splitlines()[0]}") from e

    def _out_buffer(self, output: Any, device: str) -> ort.OrtValue:
        """A buffer for a small output (the loss, ``found_inf``), shaped as declared."""
        shape = output.shape if output.shape and all(isinstance(d, int) for d in output.shape) else []
        array = np.zeros(shape, _ORT_TYPES.get(output.type, np.float32))
        if device == "cpu":
            return ort.OrtValue.ortvalue_from_numpy(array)
        return ort.OrtValue.ortvalue_from_numpy(array, device, self.device_id)

    def _device_value(self, array: np.ndarray) -> ort.OrtValue:
        # Not np.ascontiguousarray: it turns a scalar into shape [1].
        return ort.OrtValue.ortvalue_from_numpy(np.array(array, copy=True, order="C"), self.device, self.device_id)

    def _set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Upload ``values`` into the state buffers, allocating both sets and prebinding both
        ways on first use. Later calls (a checkpoint load) overwrite the buffers in place, so
        captured CUDA graphs keep reading the same addresses."""
        arrays = {name: np.asarray(values[name]) for name, _ in self.pairs}
        current = getattr(self, "_state", None)
        if current is not None and all(
            tuple(current[n].shape()) == a.shape and np.dtype(_ORT_TYPES.get(current[n].data_type(), object)) == a.dtype
            for n, a in arrays.items()
        ):
            for name, array in arrays.items():
                current[name].update_inplace(np.array(array, copy=True, order="C"))
            return
        self._state: dict[str, ort.OrtValue] = {}
        self._spare: dict[str, ort.OrtValue] = {}
        for name, array in arrays.items():
            self._state[name] = self._device_value(array)
            self._spare[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                list(array.shape), array.dtype, self.device, self.device_id
            )
        self._bindings = self._pair_bindings(self.session, self._loss_out, self._found_out, self._lr_buf)
        self._replay = None  # new addresses: capture again at the next step
        self._parity = 0

    def _pair_bindings(self, session: ort.InferenceSession, loss: ort.OrtValue, found: ort.OrtValue | None,
                       lr: ort.OrtValue | None) -> list[ort.IOBinding]:
        """Two bindings indexed by the current parity: ``[p]`` reads the current state set."""
        read_state = self._make_binding(session, self._state, self._spare, loss, found, lr)
        read_spare = self._make_binding(session, self._spare, self._state, loss, found, lr)
        return [read_state, read_spare] if getattr(self, "_parity", 0) == 0 else [read_spare, read_state]

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
        return {name: self._state[name].numpy().copy() for name, _ in self.pairs}

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` without loss scaling."""
        return float(self._state[md.LOSS_SCALE].numpy().reshape(-1)[0]) if self.has_loss_scale else None

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
        from mpgraph.specialize import specialize_shapes

        names = [spec.name for spec in self.data_inputs]
        signature = self._signature(batch, names)
        try:
            fixed = specialize_shapes(ir.from_proto(onnx.load_from_string(self._session_bytes)),
                                      {n: shape for n, (shape, _) in signature.items()})
            session = self._new_session(graph=True, model=ir.to_proto(fixed).SerializeToString())
        except MpgraphError as e:
            self._graph_off(str(e))
            return
        outputs = {o.name: o for o in session.get_outputs()}
        loss = self._out_buffer(outputs[self.loss_name], self.device)
        found = self._out_buffer(outputs[self.found_inf_name], self.device) if self.found_inf_name else None
        lr = None
        if self._lr_value is not None:
            lr = ort.OrtValue.ortvalue_from_numpy(np.asarray(self._lr_value, np.float32), self.device, self.device_id)
        bufs = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(batch[n]), self.device, self.device_id)
                for n in names}
        bindings = self._pair_bindings(session, loss, found, lr)
        for binding in bindings:
            for n, buf in bufs.items():
                binding.bind_ortvalue_input(n, buf)
        self._replay = _Replay(session, bindings, bufs, signature, loss, found, lr)
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

    def step(self, batch: Mapping[str, np.ndarray], lr: float | None = None) -> StepResult:
        """Run one training step on ``batch`` (data input name -> array).

        Args:
            batch: Arrays for every data input (``x``, ``label``, ...).
            lr: Learning rate (``None``: the one in use, i.e. a resumed checkpoint's, else the
                graph's default).
        """
        start = time.perf_counter()
        self._bind_lr(lr)
        for spec in self.data_inputs:
            if spec.name not in batch:
                raise MpgraphError(f"batch has no array for input '{spec.name}' (got {', '.join(batch)})")
        scale = self.loss_scale if self.has_loss_scale and self.track_scale else None
        if self._want_graph and self._replay is None:
            self._start_replay(batch)
        replay = self._replay
        ran = False
        if replay is not None and self._signature(batch, replay.batch) == replay.signature:
            for name, buf in replay.batch.items():
                buf.update_inplace(np.ascontiguousarray(batch[name]))
            run_options = ort.RunOptions()
            # Graph ids 1 and 2: one captured graph per buffer parity (0 is ORT's own default).
            run_options.add_run_config_entry("gpu_graph_id", str(1 + self._parity))
            try:
                replay.session.run_with_iobinding(replay.bindings[self._parity], run_options)
                ran = True
            except Exception as e:  # noqa: BLE001 - ORT raises RuntimeError/Fail types
                # A kernel that refuses capture (e.g. Concat over 32 inputs) fails here, before
                # any state input is touched: the step runs again without graphs.
                self._replay = None
                self._graph_off(f"capture failed: {str(e).splitlines()[0][:300]}")
            loss_buf, found_buf = replay.loss, replay.found
        if not ran:
            binding = self._bindings[self._parity]
            # The binding points into these arrays' memory: hold them until the next step.
            self._keep = []
            for spec in self.data_inputs:
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(batch[spec.name]))
                self._keep.append(value)
                binding.bind_ortvalue_input(spec.name, value)
            self.session.run_with_iobinding(binding)
            loss_buf, found_buf = self._loss_out, self._found_out
        self._state, self._spare = self._spare, self._state
        self._parity ^= 1
        self.steps += 1
        loss = float(loss_buf.numpy().reshape(-1)[0])
        skipped = bool(found_buf.numpy().reshape(-1)[0]) if found_buf is not None else False
        result = StepResult(loss, scale, skipped, time.perf_counter() - start)
        self.metrics.append(self.steps, result)
        return result

    def _batches_for(self, data: Dataset | Mapping[str, np.ndarray], batch_size: int, seed: int) -> Batches:
        source = data.train if isinstance(data, Dataset) else data
        b = self._batches
        if b is None or self._batches_source is not source or b.batch_size != min(batch_size, b.n) or b.seed != seed:
            position = self._pending_position or (0, 0)
            b = self._batches = Batches(source, batch_size, seed, position)
            self._batches_source = source
            self._pending_position = None
        return b

    def fit(
        self,
        data: Dataset | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]],
        steps: int,
        lr: float | None = None,
        *,
        batch_size: int = 64,
        seed: int = 0,
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

        Args:
            data: A ``Dataset`` (its train split) or arrays by input name: batched in a seeded
                order whose position checkpoints keep; or any iterable of ready batches.
            steps: Steps to run now.
            lr: Learning rate (``None``: the one in use, i.e. a resumed checkpoint's, else the
                graph's default).
            batch_size: Samples per batch.
            seed: Shuffle seed.
            progress: Log the loss at INFO level about every tenth of the run.
            callback: Called after every step with the step number and its result.
            on_nonfinite: ``stop`` (raise ``TrainingError`` naming the step; the state is
                that of the last good step), ``skip`` (the step counts but leaves the state as
                it was, recorded as skipped with a NaN loss) or ``ignore`` (train on it).
            stop: Polled before each step; True ends the run early.

        Raises:
            TrainingError: A non-finite batch or loss with ``on_nonfinite="stop"``.
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
        every = max(steps // 10, 1)
        self.stop_reason = ""
        run_skips = 0
        warned = False
        for i in range(steps):
            if stop is not None and stop():
                self.stop_reason = getattr(stop, "name", "") or "stop requested"
                break
            position = it.position if isinstance(it, Batches) else None
            try:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                problem = None if on_nonfinite == "ignore" else _nonfinite_arrays(batch)
                if problem is not None:
                    result = self._refuse(f"step {self.steps + 1}: the batch has {problem}", on_nonfinite)
                else:
                    result = self.step(batch, lr)
                    if on_nonfinite != "ignore" and not result.skipped and not math.isfinite(result.loss):
                        self._undo_step()
                        result = self._refuse(f"step {self.steps + 1}: the loss is {result.loss} "
                                              "(the update was undone)", on_nonfinite)
            except BaseException:
                if position is not None and isinstance(it, Batches):
                    it.seek(position)
                raise
            run_skips = run_skips + 1 if result.skipped else 0
            if run_skips >= COLLAPSE_SKIPS and not warned:
                warned = True
                scale = f" (loss scale now {self.loss_scale:g})" if self.has_loss_scale else ""
                logger.warning(
                    "loss scale collapsed: %d consecutive steps skipped for non-finite gradients, up to step %d%s; "
                    "check the data and the model for inf/NaN, or train in bfloat16", run_skips, self.steps, scale)
            if callback is not None:
                callback(self.steps, result)
            if progress and ((i + 1) % every == 0 or i + 1 == steps):
                logger.info("step %d: loss %.5g%s%s", self.steps, result.loss,
                            f", scale {result.loss_scale:g}" if result.loss_scale is not None else "",
                            ", skipped" if result.skipped else "")
        return self.metrics

    def _undo_step(self) -> None:
        """Go back to the state before the last step: its input buffers were never written."""
        self._state, self._spare = self._spare, self._state
        self._parity ^= 1
        self.steps -= 1
        self.metrics.truncate(self.steps)

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
            if node.op_type not in _LOSS_OPS or len(node.inputs) < 2:
                continue
            scores, labels = node.inputs[0], node.inputs[1]
            if labels is None or labels.name not in origin or scores is None or scores.shape is None:
                continue
            if len(scores.shape) < 2 or not isinstance(scores.shape[1], int):
                continue
            attr = node.attributes.get("ignore_index")
            out[origin[labels.name]] = (int(scores.shape[1]), int(attr.as_int()) if attr is not None else None)
        return out

    # -- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write all state, the step count, data position, lr and the graph fingerprint to
        ``path`` (an ``.npz``), atomically: a reader never sees a partial file. The metrics
        history goes to ``metrics_path(path)`` first (appended).

        Raises:
            CheckpointError: The file cannot be written (a full disk): the previous checkpoint
                is left as it was, and the message gives its step.
        """
        meta = {
            "format": _CHECKPOINT_FORMAT,
            "fingerprint": self.fingerprint,
            "steps": self.steps,
            "names": [name for name, _ in self.pairs],
            "data": self._batches.state() if self._batches is not None else None,
            "lr": self._lr_value,
        }
        arrays = {f"s{i}": self._state[name].numpy() for i, (name, _) in enumerate(self.pairs)}
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        try:
            self._save_metrics(Path(path))
            write_atomic(path, buf.getvalue())
        except OutputError as e:
            kept = (f"the last good checkpoint (step {self.last_checkpoint_step}) is kept"
                    if self.last_checkpoint_step is not None and Path(path).exists()
                    else "the previous checkpoint file is kept" if Path(path).exists()
                    else "no checkpoint of this run exists")
            raise CheckpointError(f"checkpoint at step {self.steps} not written: {e}; {kept}") from e
        self.last_checkpoint_step = self.steps

    def _save_metrics(self, checkpoint: Path) -> None:
        """Append the records since the last save to the history file (rewrite it whole,
        atomically, the first time in this run or after a failed append)."""
        target = metrics_path(checkpoint)
        key = target.resolve()
        done = self._metrics_written.get(key)
        if done is None or not target.exists():
            lines = "".join(json.dumps(r) + "\n" for r in self.metrics.rows())
            write_atomic(target, lines.encode())
        else:
            rows = self.metrics.rows(done)
            if rows:
                try:
                    with open(target, "a", encoding="utf-8") as f:
                        f.write("".join(json.dumps(r) + "\n" for r in rows))
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:
                    self._metrics_written.pop(key, None)  # maybe a torn line: rewrite the file next time
                    raise OutputError(f"{target}: cannot write ({e.strerror or e})") from e
        self._metrics_written[key] = len(self.metrics)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by ``save_checkpoint`` for this same graph.

        Metadata is checked key by key (type and range) before anything is restored; the
        metrics history comes from ``metrics_path(path)`` (or, for a format-1 checkpoint, from
        the checkpoint itself).

        Raises:
            CheckpointError: Missing/unreadable file, bad metadata (naming the key), a state
                array of another shape or dtype, or a checkpoint of a different graph.
        """
        from mpgraph.data import read_npz

        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"{p}: no such checkpoint")
        arrays_in = read_npz(p, CheckpointError, what="an mpgraph checkpoint", hint=False)
        if "__meta__" not in arrays_in:
            raise CheckpointError(f"{p}: not an mpgraph checkpoint (no __meta__ array; it holds "
                                  f"{', '.join(sorted(arrays_in)[:8])})")
        try:
            meta = json.loads(arrays_in["__meta__"].tobytes().decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{p}: not an mpgraph checkpoint (metadata is not JSON: {e})") from e
        meta = _check_meta(meta, p)
        if meta["fingerprint"] != self.fingerprint:
            raise CheckpointError(
                f"{p}: checkpoint is from a different graph (fingerprint {meta['fingerprint']}, this graph "
                f"{self.fingerprint}); resume with the step graph it was saved from"
            )
        names = meta["names"]
        want_names = [name for name, _ in self.pairs]
        if sorted(names) != sorted(want_names):
            raise CheckpointError(f"{p}: checkpoint state names do not match the graph (missing "
                                  f"{sorted(set(want_names) - set(names))[:5]}, extra {sorted(set(names) - set(want_names))[:5]})")
        arrays = {}
        for i, name in enumerate(names):
            key = f"s{i}"
            if key not in arrays_in:
                raise CheckpointError(f"{p}: checkpoint has no array {key} for state '{name}'")
            arrays[name] = arrays_in[key]
        for name, array in arrays.items():
            want = self._state[name]
            want_dtype = _ORT_TYPES.get(want.data_type())
            if list(array.shape) != list(want.shape()):
                raise CheckpointError(f"{p}: state '{name}' has shape {list(array.shape)}, the graph wants {want.shape()}")
            if want_dtype is not None and array.dtype != np.dtype(want_dtype):
                raise CheckpointError(f"{p}: state '{name}' is {array.dtype}, the graph wants {np.dtype(want_dtype)}")
        self._set_state(arrays)
        self.steps = meta["steps"]
        history = _read_metrics_file(metrics_path(p), self.steps)
        if history is None and isinstance(meta.get("metrics"), Mapping):
            try:
                history = Metrics.from_dict(meta["metrics"])
            except (KeyError, TypeError, ValueError):
                history = None
        self.metrics = history if history is not None else Metrics()
        self._metrics_written = {}
        self.last_checkpoint_step = self.steps
        data = meta.get("data")
        self._batches = None
        self._pending_position = (data["epoch"], data["index"]) if data else None
        self._lr_value = None
        self._lr_buf = None
        if meta.get("lr") is not None:
            self._bind_lr(meta["lr"])

    # -- inspection ----------------------------------------------------------------------

    def node_providers(self) -> dict[str, str]:
        """Node name -> execution provider ORT assigned it (empty if this ORT cannot say)."""
        get = getattr(self.session, "get_provider_graph_assignment_info", None)
        if get is None:
            return {}
        out: dict[str, str] = {}
        for sub in get():
            for node in sub.get_nodes():
                out[node.name] = sub.ep_name
        return out

    def _check_fallback(self, allow: bool) -> None:
        assignment = self.node_providers()
        if not assignment:
            logger.warning("this onnxruntime does not report node placement; CPU fallback not checked")
            return
        nodes = {n.name: n for n in self.model.graph}
        bad = []
        for name, ep in assignment.items():
            node = nodes.get(name)
            if ep != "CPUExecutionProvider" or node is None:
                continue
            # A float result computed only from integer inputs (Cast(Size) in a mean's
            # backward) is shape arithmetic that ORT keeps on CPU on purpose; float data isn't.
            float_out = any(o.dtype is not None and o.dtype.is_floating_point() for o in node.outputs)
            float_in = any(i is not None and i.dtype is not None and i.dtype.is_floating_point() for i in node.inputs)
            if float_out and float_in:
                bad.append(f"{name} ({node.op_type})")
        if bad and not allow:
            # ORT CUDA has no training-mode BatchNormalization kernel at opset >= 14.
            hint = ("; build the step graph with `mpgraph train-graph --batchnorm train-ops` for CUDA"
                    if any("(BatchNormalization)" in b for b in bad) else "")
            raise MpgraphError(
                f"{len(bad)} float node(s) fall back to CPU on cuda, e.g. {', '.join(bad[:4])}; "
                f"pass --allow-cpu-fallback to run anyway{hint}"
            )
        if bad:
            logger.warning("%d float nodes run on CPU: %s", len(bad), ", ".join(bad[:8]))

    # -- evaluation ----------------------------------------------------------------------

    def _logits_name(self) -> str:
        values = {v.name for n in self.model.graph for v in n.outputs}
        if "logits" in values:
            return "logits"
        for node in self.model.graph:
            if node.op_type in _LOSS_OPS and node.inputs[0] is not None and node.inputs[0].name:
                return node.inputs[0].name
        raise MpgraphError("cannot evaluate: the step graph has no 'logits' value and no SoftmaxCrossEntropyLoss/NLL loss op")

    def forward_model(self) -> onnx.ModelProto:
        """The forward part of the step graph: data inputs and parameters -> ``logits``."""
        proto = ir.to_proto(self.model)
        target = self._logits_name()
        needed = {target}
        keep = []
        for node in reversed(proto.graph.node):
            if any(o in needed for o in node.output):
                keep.append(node)
                needed.update(i for i in node.input if i)
        keep.reverse()
        state_names = {a for a, _ in self.pairs}
        g = proto.graph
        logits = next((v for n in self.model.graph for v in n.outputs if v.name == target), None)
        elem = logits.dtype.value if logits is not None and logits.dtype is not None else onnx.TensorProto.FLOAT
        output = target
        if elem != onnx.TensorProto.FLOAT:
            # Native low-precision logits: numpy has no bfloat16, so read them as float32.
            output = f"{target}/float32"
            keep.append(onnx.helper.make_node("Cast", [target], [output], name=output, to=onnx.TensorProto.FLOAT))
        graph = onnx.helper.make_graph(
            keep, "forward",
            [i for i in g.input if i.name in needed],
            [onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)],
            initializer=[t for t in g.initializer if t.name in needed and t.name not in state_names],
        )
        fwd = onnx.helper.make_model(graph, opset_imports=list(proto.opset_import))
        fwd.ir_version = proto.ir_version
        return fwd

    def _eval_session(self) -> tuple[ort.InferenceSession, str, list[str]]:
        if self._eval is None:
            fwd = self.forward_model()
            options = ort.SessionOptions()
            options.log_severity_level = 3
            providers = self.session.get_providers()
            session = ort.InferenceSession(fwd.SerializeToString(), options, providers=providers)
            self._eval = (session, fwd.graph.output[0].name, [i.name for i in fwd.graph.input])
        return self._eval

    def predict(self, arrays: Mapping[str, np.ndarray], batch_size: int = 512) -> np.ndarray:
        """Logits of the forward model on ``arrays`` with the current parameters."""
        session, out_name, inputs = self._eval_session()
        state_names = {a for a, _ in self.pairs}
        n = len(next(iter(arrays.values())))
        parts = []
        for start in range(0, n, batch_size):
            binding = session.io_binding()
            keep = []
            for name in inputs:
                if name in state_names:
                    binding.bind_ortvalue_input(name, self._state[name])
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


def plot_losses(runs: Mapping[str, Metrics | Mapping[str, Any]], path: str | os.PathLike[str], *,
                title: str | None = None) -> None:
    """Draw the loss curves of several runs in one PNG (skipped steps marked with x).

    Args:
        runs: Label -> ``Metrics`` (or its ``to_dict()``).
        path: Output ``.png`` (written atomically).
        title: Figure title.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MpgraphError("plotting needs matplotlib: pip install 'mpgraph[data]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    positive = True
    try:
        for label, m in runs.items():
            d = m.to_dict() if isinstance(m, Metrics) else m
            steps = np.asarray(d["step"])
            loss = np.asarray([math.nan if x is None else x for x in d["loss"]], dtype=np.float64)
            positive = positive and bool(np.all(loss[np.isfinite(loss)] > 0))
            line, = ax.plot(steps, loss, label=label, linewidth=1.2)
            skipped = np.asarray(d["skipped"], dtype=bool)
            if skipped.any():
                y = np.where(np.isfinite(loss[skipped]), loss[skipped], np.nanmax(loss) if np.isfinite(loss).any() else 1.0)
                ax.scatter(steps[skipped], y, marker="x", color=line.get_color(), s=16, label=f"{label}: skipped")
        if positive:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if title:
            ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    _write_atomic(path, buf.getvalue())
