"""ONNX Runtime sessions of a step graph: providers, options, placement, and the forward part.

Rules checked before a step graph gets a session (``check_provider``):

1. The provider must be available in this ORT build (``cuda`` needs onnxruntime-gpu).
2. A native float16/bfloat16 lowering (``mpgraph.dtype`` set, ``mpgraph.emulated`` not
   ``true``) does not run on the CPU provider; convert with ``--emulate`` for CPU.
3. A graph converted for a target whose kernels the provider lacks is refused
   (``mpgraph.targets.check_runnable``).

On CUDA (``check_cuda_session``) session-level fallback is disabled (a CUDA failure is an
error, not a silent CPU session), and no float-producing node may be assigned to the CPU
provider unless allowed. Integer/bool shape arithmetic that ORT places on CPU on purpose is
allowed. ``node_providers`` returns the assignment.

Example:
    >>> PROVIDERS["cuda"]
    'CUDAExecutionProvider'
    >>> provider_options({}, "cuda", device_id=1, tf32=None, extra={"arena_extend_strategy": 1})
    (False, {'device_id': '1', 'use_tf32': '0', 'arena_extend_strategy': '1'})
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from mpgraph import targets
from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph.errors import MpgraphError, UsageError

__all__ = [
    "PROVIDERS",
    "ORT_TYPES",
    "check_provider",
    "provider_options",
    "new_session",
    "check_cuda_session",
    "node_providers",
    "logits_name",
    "eval_session",
    "ort_error",
    "exact_device_values",
    "reserve_device_values",
    "set_default_logger_severity",
]

logger = logging.getLogger(__name__)

#: Short provider names -> ORT execution providers.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: ORT's type strings -> numpy dtypes, for the buffers a trainer allocates.
ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
    "tensor(uint8)": np.uint8, "tensor(int8)": np.int8,
}
_ORT_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)' Status Message: (.*)")


def check_provider(model: ir.Model, provider: str) -> list[str]:
    """Refuse a provider that this ORT lacks or that cannot run ``model``; return notes.

    Raises:
        MpgraphError: Unknown or unavailable provider, a native low-precision graph on CPU,
            or a graph converted for a target whose kernels ``provider`` lacks.
    """
    if provider not in PROVIDERS:
        raise MpgraphError(f"unknown provider '{provider}'; valid: {', '.join(PROVIDERS)}")
    ep = PROVIDERS[provider]
    if ep not in ort.get_available_providers():
        raise MpgraphError(
            f"provider '{provider}' ({ep}) is not available in this onnxruntime build "
            f"(available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu for cuda"
        )
    props = model.metadata_props
    dtype = props.get(md.MODEL_DTYPE)
    if provider == "cpu" and dtype in ("float16", "bfloat16") and props.get(md.MODEL_EMULATED) != "true":
        raise MpgraphError(
            f"this graph is a native {dtype} lowering, which ORT's CPU provider cannot run "
            f"(no {dtype} compute kernels); convert the fp32 step graph with --emulate for CPU, or use --provider cuda"
        )
    return targets.check_runnable(model, provider)


def provider_options(
    props: Mapping[str, str], provider: str, *, device_id: int, tf32: bool | None, extra: Mapping[str, Any] | None
) -> tuple[bool, dict[str, str]]:
    """Whether float32 matmuls may run as TF32, and the execution provider's options.

    Args:
        props: The step graph's metadata; ``mpgraph.tf32`` (the ``tf32`` preset) decides
            TF32 when ``tf32`` is ``None``. Absent means strict float32 (``use_tf32=0``),
            because ORT's CUDA provider would otherwise use TF32 silently.
        provider: ``cpu`` or ``cuda``.
        device_id: CUDA device ordinal.
        tf32: An explicit choice, or ``None`` for the graph's.
        extra: The caller's options (ORT's names); they win over the derived ones.
    """
    use_tf32 = (props.get(md.MODEL_TF32) == "true") if tf32 is None else bool(tf32)
    options: dict[str, str] = {}
    if provider == "cuda":
        options = {"device_id": str(device_id), "use_tf32": "1" if use_tf32 else "0"}
    options.update({str(k): str(v) for k, v in (extra or {}).items()})
    return use_tf32, options


def session_log_severity() -> int:
    """The sessions' ORT log severity: 4 (fatal only), or ``$MPGRAPH_ORT_LOG_SEVERITY`` (0-4).

    Raises:
        UsageError: ``$MPGRAPH_ORT_LOG_SEVERITY`` is not one of 0-4.
    """
    value = os.environ.get("MPGRAPH_ORT_LOG_SEVERITY", "").strip()
    if not value:
        return 4
    if value not in {"0", "1", "2", "3", "4"}:
        raise UsageError(f"MPGRAPH_ORT_LOG_SEVERITY must be one of 0 (verbose) to 4 (fatal), got {value!r}")
    return int(value)


def _optimized_model_path(folder: str, provider: str, cuda_graph: bool) -> str:
    """A new file name in ``folder`` (made if missing) for the next session's optimized graph:
    ``<provider>[-graph]-<n>.onnx``, n counting the files already there."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    stem = f"{provider}{'-graph' if cuda_graph else ''}"
    n = len(list(path.glob(f"{stem}-*.onnx")))
    return str(path / f"{stem}-{n}.onnx")


#: ORT's default-logger severity as mpgraph last set it (``set_default_logger_severity``); ORT
#: starts at 2 (warnings) and cannot be asked.
_logger_severity = 2
#: Whether ``exact_device_values`` ran in this process, and what it did.
_exact_device_values: bool | None = None


def set_default_logger_severity(level: int) -> None:
    """``onnxruntime.set_default_logger_severity(level)``, remembered, so mpgraph can put it back
    after silencing ORT for one call (``exact_device_values``). Scripts that want ORT's default
    logger at another level (the arenas log their growth at 1) set it through here."""
    global _logger_severity
    ort.set_default_logger_severity(level)
    _logger_severity = level


def exact_device_values() -> bool:
    """Make the CUDA device values made from Python (``OrtValue.ortvalue_from_numpy`` and
    ``ortvalue_from_shape_and_type`` on ``cuda``: a Trainer's state sets, batch and loss buffers)
    grow their arena by exactly what each needs (``kSameAsRequested``), as the Trainer's sessions
    do, instead of ORT's default next power of two. Returns whether it could.

    onnxruntime-gpu makes one BFC arena per device for those values, the first time one is made,
    from a process-wide setting (``set_arena_extend_strategy``, deprecated since ORT has the
    provider option; the value arena has no option). With the default, its regions double up to
    1 GiB each: a 1 GiB state fills regions of 1, 4, 4, 8 ... 512 MiB to the last few bytes, and the
    first small buffer after it (a 64-byte request as the captured step was set up) adds a 1 GiB region, most of it
    never used. That was ViT-B/16's step on the H200 (``benchmarks/results/
    trainer_memory_vit_dynamo_arena_log_2026-12-03T12.txt``): 1.71 GiB of arena growth in step 1,
    1 GiB of it this region, where its session's own arena grew 0.81 (``capture_arena_ab.py``).

    It must run before the first device value of the process: later, the arena exists and keeps
    its growth (nothing reports that; the setting then changes nothing). It sets the process-wide
    value once and leaves it, so a CUDA session made elsewhere without an ``arena_extend_strategy``
    option grows its arena exactly too. ORT logs a deprecation warning when the setting changes;
    the default logger is raised above warnings for that one call and put back at the level set
    through ``set_default_logger_severity`` (2, ORT's default, otherwise). A build without CUDA
    (``set_arena_extend_strategy`` absent) returns False and changes nothing.
    """
    global _exact_device_values
    if _exact_device_values is not None:
        return _exact_device_values
    from onnxruntime.capi import _pybind_state as C

    setter, strategy = getattr(C, "set_arena_extend_strategy", None), getattr(C, "ArenaExtendStrategy", None)
    if setter is None or strategy is None:
        _exact_device_values = False
        return False
    ort.set_default_logger_severity(3)
    try:
        setter(strategy.kSameAsRequested)
    finally:
        ort.set_default_logger_severity(_logger_severity)
    logger.debug("device values made from Python grow their arena as requested (kSameAsRequested)")
    _exact_device_values = True
    return True


#: onnxruntime's BFC arenas hand out multiples of this many bytes.
ARENA_GRANULE = 256
#: Room left in the reserved region for the small values made after the state (loss, batch).
RESERVE_SLACK = 4 << 20


def reserve_device_values(sizes: list[int], device_id: int = 0) -> int:
    """Grow the arena of device values made from Python (``exact_device_values``) by one region
    that the values of ``sizes`` bytes, made next, fill: a buffer that size is made and freed, and
    the arena, which keeps its regions, carves the values out of it. Without it, an exact
    (``kSameAsRequested``) arena makes one ``cudaMalloc`` a value, and device memory grows by more
    than the values hold: ViT-B/16's 352 state values grew it 0.29 GiB over their 0.97 GiB on the
    H200 (``benchmarks/results/trainer_memory_vit_dynamo_exact_values_2026-12-03T14.txt``
    against ``..._by_run_2026-12-03T12.txt``: 1.44 GiB at init, 1.15 with ORT's power-of-two
    regions). Each size counts as the arena rounds it, plus ``RESERVE_SLACK``. Returns the bytes
    reserved (0 where the arena is not exact: a power-of-two arena sizes its own regions)."""
    if not exact_device_values() or not sizes:
        return 0
    total = sum(-(-max(n, 1) // ARENA_GRANULE) * ARENA_GRANULE for n in sizes) + RESERVE_SLACK
    region = ort.OrtValue.ortvalue_from_shape_and_type([total], np.uint8, "cuda", device_id)
    del region
    return total


def new_session(model: bytes, provider: str, options: Mapping[str, str], *, threads: int | None,
                cuda_graph: bool = False, custom_ops: str | None = None,
                mem_pattern: bool | None = None, deterministic: bool = False) -> ort.InferenceSession:
    """An ORT session of a step graph on ``provider`` (CUDA falls back to CPU per node only).

    Args:
        model: The serialized graph.
        provider: ``cpu`` or ``cuda``.
        options: The execution provider's options (``provider_options``).
        threads: Intra-op threads (``None``: ORT's default).
        cuda_graph: Turn on CUDA graph capture (CUDA only).
        custom_ops: A custom-op library to register (``mpgraph.lowering.library``).
        mem_pattern: ``SessionOptions.enable_mem_pattern`` (``None``: ORT's default, on).
        deterministic: ``SessionOptions.use_deterministic_compute``: kernels that give the same
            bits every run (e.g. cuDNN's deterministic convolution algorithms), where ORT has them.

    Raises:
        MpgraphError: ORT cannot load the graph (the first line of its message).
    """
    session_options = ort.SessionOptions()
    # Fatal only: warnings would be one "Initializer X appears in graph inputs" per state
    # tensor, and a failing node's error log repeats the exception the caller reports.
    # $MPGRAPH_ORT_LOG_SEVERITY (0 verbose .. 4 fatal) says otherwise, to diagnose a session
    # (1: the CUDA graph capture's "Start another run" lines, benchmarks/trainer_memory.py).
    session_options.log_severity_level = session_log_severity()
    # $MPGRAPH_ORT_OPTIMIZED_MODELS (a folder): each session writes the graph ORT runs after its
    # own optimizations there, to compare with mpgraph's plan (``audit --memory`` on it).
    if folder := os.environ.get("MPGRAPH_ORT_OPTIMIZED_MODELS", "").strip():
        session_options.optimized_model_filepath = _optimized_model_path(folder, provider, cuda_graph)
    session_options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if threads is not None:
        session_options.intra_op_num_threads = threads
    if custom_ops is not None:
        session_options.register_custom_ops_library(custom_ops)
    if mem_pattern is not None:
        session_options.enable_mem_pattern = mem_pattern
    session_options.use_deterministic_compute = deterministic
    ep_options = dict(options)
    if provider == "cuda":  # every CUDA session, so before an Executor uploads its state
        exact_device_values()
    if cuda_graph and provider == "cuda":
        ep_options["enable_cuda_graph"] = "1"
    providers: list[Any] = [(PROVIDERS[provider], ep_options)] + (["CPUExecutionProvider"] if provider == "cuda" else [])
    try:
        return ort.InferenceSession(model, session_options, providers=providers)
    except Exception as e:  # noqa: BLE001 - ORT raises its own Fail/InvalidGraph types
        what = " with CUDA graph capture" if cuda_graph else ""
        raise MpgraphError(f"onnxruntime cannot load the step graph on {provider}{what}: {str(e).splitlines()[0]}") from e


def node_providers(session: ort.InferenceSession) -> dict[str, str]:
    """Node name -> execution provider ORT assigned it (empty if this ORT cannot say)."""
    get = getattr(session, "get_provider_graph_assignment_info", None)
    if get is None:
        return {}
    out: dict[str, str] = {}
    for sub in get():
        for node in sub.get_nodes():
            out[node.name] = sub.ep_name
    return out


def check_cuda_session(session: ort.InferenceSession, model: ir.Model, *, allow_cpu_fallback: bool) -> None:
    """Disable session-level fallback and refuse float nodes that ORT placed on CPU.

    Raises:
        MpgraphError: ORT did not start the CUDA provider, or float nodes run on CPU and
            ``allow_cpu_fallback`` is false (naming them, with the fix).
    """
    session.disable_fallback()
    if PROVIDERS["cuda"] not in session.get_providers():
        raise MpgraphError(f"onnxruntime did not start {PROVIDERS['cuda']} for this graph")
    assignment = node_providers(session)
    if not assignment:
        logger.warning("this onnxruntime does not report node placement; CPU fallback not checked")
        return
    nodes = {n.name: n for n in model.graph}
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
    if bad and not allow_cpu_fallback:
        # ORT CUDA has no training-mode BatchNormalization kernel at opset >= 14.
        hint = ("; build the step graph with `mpgraph train-graph --batchnorm train-ops` for CUDA"
                if any("(BatchNormalization)" in b for b in bad) else "")
        raise MpgraphError(
            f"{len(bad)} float node(s) fall back to CPU on cuda, e.g. {', '.join(bad[:4])}; "
            f"pass --allow-cpu-fallback to run anyway{hint}"
        )
    if bad:
        logger.warning("%d float nodes run on CPU: %s", len(bad), ", ".join(bad[:8]))


def logits_name(model: ir.Model) -> str:
    """The logits of a step graph, as its contract names them (``StepContract.logits``: the
    recorded value; for a graph saved before that key, the value named ``logits``, else the
    scores input of the loss op).

    Raises:
        MpgraphError: Not a step graph, or one with neither recorded logits, a value named
            ``logits`` nor a loss op.
    """
    logits = StepContract.read(model).logits if StepContract.recorded(model) else None
    if logits is None:
        raise MpgraphError("cannot evaluate: the step graph has no 'logits' value and no SoftmaxCrossEntropyLoss/NLL loss op")
    return logits


def eval_session(graph: bytes, providers: list[Any]) -> ort.InferenceSession:
    """An inference session of a forward plan's graph (``PlanOptions.forward_of``) on the
    trainer's providers (names, or (name, options) pairs: a device id)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(graph, options, providers=providers)


def ort_error(error: Exception, what: str) -> MpgraphError | None:
    """One line for an ONNX Runtime failure (naming the node when ORT does), else ``None``.

    Example:
        >>> e = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while "
        ...                  "running Gather node. Name:'emb' Status Message: indices out of bounds")
        >>> print(ort_error(e, "running step 1"))
        onnxruntime failed running step 1 at node 'emb' (Gather): indices out of bounds
        >>> ort_error(ValueError("not ours"), "running step 1") is None
        True
    """
    text = str(error).strip()
    from_ort = type(error).__module__.startswith("onnxruntime") or (
        isinstance(error, RuntimeError) and any(k in text for k in ("ONNXRuntimeError", "status code", "Error in execution")))
    if not from_ort:
        return None
    match = _ORT_NODE.search(text)
    if match is not None:
        return MpgraphError(f"onnxruntime failed {what} at node '{match[2]}' ({match[1]}): {match[3].splitlines()[0]}")
    first = text.splitlines()[0] if text else type(error).__name__
    return MpgraphError(f"onnxruntime failed {what}: {first.replace('[ONNXRuntimeError] : ', '')}")
