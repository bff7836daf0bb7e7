"""What the step benchmarks share: a configuration's record, alternating timed rounds, the
device memory a configuration holds, the kernel count from CUPTI, and the run's header.

``gpu_step.py`` (the bench GPT and the small nets) and ``real_models.py`` (transformers' models)
time their configurations the same way, so their numbers can be read side by side:

- every configuration steps ``steps_per_round`` times per round, the configurations taking turns
  round by round (a slow drift of the machine lands on all of them alike); round 0 is a warm-up
  (compilation, CUDA-graph capture, arena growth) and is left out of the median;
- every step reads its loss back to the host (what a training loop that logs the loss does);
- device memory in the process that times them (``memory_mib``) is what ``cudaMemGetInfo`` says
  the process took while the configuration was created plus what its first round added: it
  counts ORT's arenas and torch's cache alike, which neither framework's own counter does for the
  other, but it depends on the order (the first ORT configuration of a process pays ORT's one-time
  CUDA handles and workspaces; memory an earlier one freed is not always returned). The
  order-independent number is ``peak_over_steps`` run in a fresh child process per configuration
  (``real_models.py``);
- kernels per step come from torch's profiler (CUPTI sees every kernel in the process, ORT's too).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch


@dataclass
class Run:
    """One configuration: a step function, its losses, its per-round timings."""

    label: str
    step: Callable[[int], float]
    twin: str | None = None
    device: str = "cuda"
    losses: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)
    memory_mib: float | None = None
    mem_created: float = 0.0
    note: str = ""
    error: str = ""
    trainer: Any = None  # mpgraph.Trainer for the mpgraph rows
    # ``peak_over_steps`` of this configuration in a fresh child process (or {"error": ...}).
    peak: dict[str, Any] | None = None
    # Steps i .. i+n-1 at once, their losses (the pipelined rows: Trainer.step_many).
    steps: Callable[[int, int], list[float]] | None = None


def error_line(e: BaseException) -> str:
    """``Type: first line of the message``: what a row shows when its configuration failed."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def device_used_mib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def host_rss_mib(peak: bool = False) -> float:
    """This process's resident memory (``VmRSS``), or its high-water mark (``VmHWM``), in MiB."""
    key = "VmHWM:" if peak else "VmRSS:"
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))


def reset_host_peak() -> None:
    """Start ``host_rss_mib(peak=True)`` afresh from the current resident memory (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_over_steps(make: Callable[[], Run], steps: int, used: Callable[[], float],
                    mark: Callable[[str], None] = lambda phase: None) -> dict[str, Any]:
    """Make a configuration and step it ``steps`` times, reading ``used()`` (MiB over the
    baseline the caller took) once it exists and after every step; a pipelined row takes its
    first ``steps - 1`` steps in one call, as it runs in its rounds, then one more. ``mark(phase)``
    before each phase (``init``, ``step1``...). ORT's arenas and torch's cache keep what they
    took, so the largest reading is the peak.
    """
    mark("init")
    run = make()
    if run.error:
        raise RuntimeError(run.error)
    after = [used()]
    losses: list[float] = []
    if run.steps is not None:
        for n in (steps - 1, 1) if steps > 1 else (steps,):
            mark(f"step{len(losses) + 1}")
            losses += run.steps(len(losses), n)
            after.append(used())
    else:
        for i in range(steps):
            mark(f"step{i + 1}")
            losses.append(run.step(i))
            after.append(used())
    return {"created_mib": after[0], "after_steps_mib": after[1:], "peak_mib": max(after), "steps": steps,
            "losses": losses}


def create_run(label: str, make: Callable[[], Run], cuda: bool) -> Run:
    """``make()``, with the device memory creating it took; a failure becomes a row with its error."""
    if cuda:
        torch.cuda.empty_cache()
    before = device_used_mib() if cuda else 0.0
    try:
        run = make()
    except Exception as e:  # noqa: BLE001 - one broken configuration must not stop the rest
        traceback.print_exc()
        run = Run(label, lambda i: float("nan"), error=error_line(e))
    # What creating it took (weights, state, sessions); round 0 adds what its steps take.
    run.mem_created = device_used_mib() - before if cuda else 0.0
    return run


def time_round(run: Run, steps: int) -> None:
    if run.error:
        return
    try:
        if run.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if run.steps is not None:  # one call for the round: the pipelined rows
            run.losses.extend(run.steps(len(run.losses), steps))
        for _ in range(steps if run.steps is None else 0):
            run.losses.append(run.step(len(run.losses)))
        if run.device == "cuda":
            torch.cuda.synchronize()
        run.round_ms.append((time.perf_counter() - start) * 1e3 / steps)
    except Exception as e:  # noqa: BLE001 - one broken configuration must not stop the rest
        run.error = error_line(e)
        traceback.print_exc()


def timed_rounds(runs: Sequence[Run], rounds: int, steps_per_round: int, *, cuda: bool,
                 on_round: Callable[[int], None] | None = None, cpu_threads: int | None = 2,
                 keep_torch_cache: Callable[[], bool] = lambda: False) -> None:
    """Round 0 (warm-up) and ``rounds`` timed rounds, every configuration in turn each round.

    A configuration's device memory is taken in the first round it runs in (``memory_mib``).
    After a torch configuration's first round torch's cache is emptied, so that the next one's
    memory does not count it, unless ``keep_torch_cache()`` (a captured torch CUDA graph still
    uses memory the cache would free).
    """
    threads = torch.get_num_threads()
    for r in range(rounds + 1):
        for run in runs:
            if run.device == "cpu" and cpu_threads:
                torch.set_num_threads(cpu_threads)
            measure = cuda and run.memory_mib is None and run.device == "cuda" and not run.error
            before = device_used_mib() if measure else 0.0
            time_round(run, steps_per_round)
            torch.set_num_threads(threads)
            if measure:
                # Device memory this configuration holds: what creating it took plus what its
                # first steps added (ORT keeps its arenas; torch's cache is emptied after each
                # torch configuration's first round). Every configuration exists before its
                # first round, so a difference against the time it was made would count the later ones.
                run.memory_mib = run.mem_created + device_used_mib() - before
                if run.label.startswith("torch") and not keep_torch_cache():
                    torch.cuda.empty_cache()
        if on_round is not None:
            on_round(r)


KERNEL_CLASSES = [
    ("matmul", re.compile(r"gemm|cutlass|xmma|sm90_|sm80_|cublas|nvjet|matmul", re.I)),
    ("conv", re.compile(r"conv|winograd|implicit|cudnn|wgrad|dgrad|fprop", re.I)),
    # Not "broadcast": ORT's Where kernels carry ``BroadcastIndexType`` in their names.
    ("cast", re.compile(r"(?<!broad)cast", re.I)),
    ("reduce", re.compile(r"reduce|reduction", re.I)),
    ("norm/softmax", re.compile(r"softmax|layernorm|layer_norm|norm", re.I)),
    ("memcpy/transpose", re.compile(r"memcpy|memset|transpose|copy|concat|split|slice|gather|scatter|expand", re.I)),
    ("elementwise", re.compile(r"elementwise|unary|binary|vectorized|_ew|where|pow|sqrt|mul|add|sub|div|erf|exp", re.I)),
]


#: How many kernel names ``kernel_breakdown`` lists, by time per step.
TOP_KERNELS = 25


def kernel_breakdown(run: Run, steps: int = 3) -> dict[str, Any]:
    """Kernels per step by class, and the ``TOP_KERNELS`` names that take the most time, from
    CUPTI (torch.profiler sees every kernel in the process)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.losses.append(run.step(len(run.losses)))
        torch.cuda.synchronize()
    classes: dict[str, list[float]] = {}
    names: dict[str, list[float]] = {}
    total_n, total_us = 0, 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        cls = next((c for c, rx in KERNEL_CLASSES if rx.search(event.name)), "other")
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        for table, key in ((classes, cls), (names, f"{cls}: {event.name[:120]}")):
            table.setdefault(key, [0, 0.0])
            table[key][0] += 1
            table[key][1] += us
        total_n += 1
        total_us += us
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {
        "kernels_per_step": total_n / steps,
        "gpu_ms_per_step": total_us / steps / 1e3,
        "by_class": {c: {"kernels": n / steps, "ms": us / steps / 1e3} for c, (n, us) in sorted(classes.items())},
        "top": [{"kernel": k, "per_step": n / steps, "ms": us / steps / 1e3} for k, (n, us) in top],
    }


def _git(*args: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_header(packages: Sequence[str] = ("torch", "onnxruntime", "onnx", "onnx_ir", "onnxscript")) -> dict[str, Any]:
    """The command, the commit (with ``+dirty`` when the tree has changes), the machine and the
    versions: what a result file's first lines must say to be rerun."""
    import importlib

    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - a package missing or broken is a fact to report
            versions[name] = None
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cuda = torch.cuda.is_available()
    providers: list[str] = []
    try:
        import onnxruntime as ort

        providers = ort.get_available_providers()
    except ImportError:
        pass
    return {
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "ort_providers": providers,
        "versions": versions,
        "kernel_library": kernel_library() if cuda and "CUDAExecutionProvider" in providers else None,
    }


def kernel_library() -> dict[str, Any]:
    """What the CUDA kernel library mpgraph's sessions load has (``mpgraph kernels``' facts: path,
    prebuilt or not, fused attention, GemmBias, why not), or why there is none: a GPU result
    whose attention ran unfused says so in its header."""
    try:
        from mpgraph.lowering.build import KernelBuildError
        from mpgraph.lowering.plan import library_facts
    except ImportError as e:
        return {"path": None, "why": f"mpgraph not importable: {e}"}
    try:
        return library_facts(cuda=True)
    except KernelBuildError as e:
        return {"path": None, "why": str(e).splitlines()[0]}


class Tee:
    """Writes to the console and to a log file (the run's ``.log``)."""

    def __init__(self, stream: TextIO, path: str) -> None:
        self.stream = stream
        self.file = open(path, "w")  # noqa: SIM115 - open for the run, closed by close()

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def isatty(self) -> bool:
        return False


def write_json(path: str, data: Any) -> None:
    """Write atomically: a run killed mid-write leaves the last complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=float)
    os.replace(tmp, path)
