"""``audit --memory``'s estimate next to the device memory ORT CUDA really takes for a step.

For the zoo GPT (``models/onnx/gpt.loss.onnx``) and the benchmark GPT of ``gpu_step.py`` (d1024,
8 layers, T512, vocab 8192, batch 8), AdamW, policies fp32 and bf16, with ORT's memory pattern
on (its default) and off, it prints the estimate (``mpgraph.audit.memory.estimate_memory``) and
what a CUDA ``Trainer`` takes, split into parts:

- **measured**: device memory in use (``cudaMemGetInfo`` through torch) after ``--steps`` steps,
  minus before anything of ORT existed. ORT's arena grows by exactly what is requested
  (``arena_extend_strategy=kSameAsRequested``), so its size is its peak and not the next power
  of two; no CUDA graphs.
- **fixed provider overhead**: the same measurement, in the same fresh process just before, for
  the zoo's tiny MLP (4,610 parameters; 0.1 MiB by the estimate) under the same policy, provider
  options and memory-pattern setting. It holds what any CUDA Trainer takes whatever the model:
  the CUDA libraries' handles and workspaces (cuBLAS/cuBLASLt, cuDNN), kernel code loaded on
  first use, the stream, the arenas' first regions. The estimate models the graph's own tensors,
  so it is compared with **measured minus fixed** (the model's own memory). The overhead is
  measured, not fitted, and shown in its own column: a user adds it once per process.
- **by phase**: what the session and state upload take (init), then step 1, step 2 and later
  steps. With the memory pattern on, ORT traces step 1's allocations and from step 2 allocates
  one block holding every planned intermediate at its planned offset; the arena keeps step 1's
  regions too, so the activations are held about twice. The step-2 row shows that block.
- **arena log**: ORT's BFC arenas log every extension at INFO on the default logger. Each
  measurement's log (``--out``/logs) is parsed per phase: bytes the device arena grew by, and
  its largest request in step 2 (the memory-pattern block, ORT's own planned activation peak).

Every measurement runs in its own process (``--child``): ORT keeps allocators per process, so a
second Trainer in the same process would be served from the first one's freed arena.

Run on a GPU machine (onnxruntime-gpu, torch with CUDA), from the repository root::

    python3 benchmarks/memory_check.py --out DIR       # both GPTs, fp32 and bf16, pattern on and off
    python3 benchmarks/memory_check.py --estimate-only # the estimates alone (any machine)
    python3 benchmarks/memory_check.py --provider cpu --models zoo_gpt --policies fp32 --out DIR
                                                       # the same procedure on ORT CPU: arena logs
                                                       # only (no device memory); a dry run
    python3 benchmarks/memory_check.py --cpu --models zoo_gpt --policies fp32 --zoo-batch 1024
                                                       # float32 on ORT CPU: peak RSS of a fresh process

Output: per (model, policy, pattern) the estimate and its parts, measured, fixed overhead,
measured minus fixed, and the error both ways (estimate / own - 1 and own / estimate - 1);
``--out DIR`` also gets ``memory_check.json`` (every number) and the ORT logs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx_ir as ir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mpgraph  # noqa: E402
from mpgraph.audit.memory import MemoryReport, estimate_memory  # noqa: E402
from mpgraph.io import save_model  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

TINY = "models/onnx/tiny_mlp.loss.onnx"
TINY_BATCH = 64
MIB = 2**20
MARK = "MPGRAPH-MARK"


def zoo_gpt(batch: int) -> tuple[ir.Model, dict[str, np.ndarray]]:
    from models.zoo import GPT_SEQ, GPT_VOCAB

    step = build_training_graph(str(ROOT / "models/onnx/gpt.loss.onnx"), optimizer="adamw",
                                optimizer_options={"weight_decay": 0.01})
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, GPT_VOCAB, (batch, GPT_SEQ), dtype=np.int64),
             "label": rng.integers(0, GPT_VOCAB, (batch, GPT_SEQ), dtype=np.int64)}
    return step, feeds


def bench_gpt(batch: int) -> tuple[ir.Model, dict[str, np.ndarray]]:
    import torch

    from models.zoo import GPT
    from mpgraph.export import export_module

    vocab, seq, d, heads, layers = 8192, 512, 1024, 16, 8
    torch.manual_seed(0)
    module = GPT(vocab=vocab, seq=seq, d_model=d, heads=heads, layers=layers).train()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    proto = export_module(copy.deepcopy(module), torch.from_numpy(tokens[:2]), loss="cross_entropy")
    step = build_training_graph(proto, optimizer="adamw", lr=3e-4, optimizer_options={"weight_decay": 0.01})
    names = [v.name for v in step.graph.inputs if v.dtype == ir.DataType.INT64]
    data = next(n for n in names if n != "label")
    return step, {data: tokens, "label": rng.integers(0, vocab, (batch, seq), dtype=np.int64)}


def tiny_mlp(batch: int) -> tuple[ir.Model, dict[str, np.ndarray]]:
    step = build_training_graph(str(ROOT / TINY), optimizer="adamw", optimizer_options={"weight_decay": 0.01})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 4)).astype(np.float32)
    return step, {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}


def convert(step: ir.Model, policy: str) -> ir.Model:
    fresh = ir.from_proto(ir.to_proto(step))
    return fresh if policy == "fp32" else mpgraph.convert(fresh, policy, validate=False)


# -- the child: one fresh process, one tiny Trainer (the fixed overhead), one model ---------------


def _device_used() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def _session_options(enabled: bool, env_allocators: bool):
    """Every ``ort.SessionOptions()`` made inside has ``enable_mem_pattern`` set to ``enabled``
    (the Trainer builds its own options; ORT's default is on) and, with ``env_allocators``, uses
    the process's registered allocators (the CPU arena with ``kSameAsRequested``)."""
    import onnxruntime as ort

    real = ort.SessionOptions

    def make() -> ort.SessionOptions:
        options = real()
        options.enable_mem_pattern = enabled
        if env_allocators:
            options.add_session_config_entry("session.use_env_allocators", "1")
        return options

    ort.SessionOptions = make
    try:
        yield
    finally:
        ort.SessionOptions = real


def _mark(phase: str) -> None:
    os.write(2, f"{MARK} {phase}\n".encode())


def _run_trainer(path: str, feeds: dict[str, np.ndarray], provider: str, steps: int, pattern: bool,
                 tag: str, before: int | None) -> dict[str, int | None]:
    """Device bytes over ``before`` after init and after each step, the Trainer deleted after."""
    from mpgraph.runtime.trainer import Trainer

    def used() -> int | None:
        now = None if before is None else _device_used()
        return None if now is None or before is None else now - before

    options = {"arena_extend_strategy": "kSameAsRequested"} if provider == "cuda" else None
    out: dict[str, int | None] = {}
    _mark(f"{tag}:init")
    with _session_options(pattern, env_allocators=provider == "cpu"):
        trainer = Trainer(path, provider, provider_options=options, cuda_graph=False if provider == "cuda" else None)
    out["init"] = used()
    for i in range(1, steps + 1):
        _mark(f"{tag}:step{min(i, 3)}")
        trainer.step(feeds)
        out[f"step{i}"] = used()
    _mark(f"{tag}:deleted")
    del trainer
    gc.collect()
    out["after_delete"] = used()
    return out


def child(args: argparse.Namespace) -> None:
    """Measure the tiny MLP then the model, in this fresh process; print one JSON line."""
    with open(args.log, "w") as log:  # ORT logs to the process's stderr: all of it goes to the log
        os.dup2(log.fileno(), 2)
    import onnxruntime as ort

    from mpgraph.runtime import providers

    providers.set_default_logger_severity(1)  # INFO: the BFC arenas log every extension
    if args.provider == "cpu":  # the CPU arena grows as the CUDA one is told to: by what is requested
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))  # max_mem, kSameAsRequested
    if args.provider == "cuda":
        import torch

        torch.cuda.init()
    before = _device_used() if args.provider == "cuda" else None
    versions = {"onnxruntime": ort.__version__, "device": _device_name() if args.provider == "cuda" else "cpu"}
    pattern = args.pattern == "on"
    tiny_feeds = dict(np.load(args.tiny_feeds))
    result = {"tiny": _run_trainer(args.tiny, tiny_feeds, args.provider, args.steps, pattern, "tiny", before)}
    start = time.perf_counter()
    result["model"] = _run_trainer(args.model_file, dict(np.load(args.feeds)), args.provider, args.steps, pattern,
                                   "model", before)
    result["model_seconds"] = time.perf_counter() - start
    result["versions"] = versions
    print(json.dumps(result), flush=True)


# -- the parent: graphs, estimates, children, the table ----------------------------------------------

_EXTENDING = re.compile(r"Extending BFCArena for (\w+)\. .*num_bytes: (\d+)")
_EXTENDED = re.compile(r"Extended allocation by (\d+) bytes")
_RESERVING = re.compile(r"Reserving memory in BFCArena for (\w+) size: (\d+)")
_CREATING = re.compile(r"Creating BFCArena for (\w+) with .*arena_extend_strategy: (-?\d+)")


_ANOTHER_RUN = "Start another run for necessary memory allocation or graph capture"


def _phased(text: str) -> Iterator[tuple[str, str | None]]:
    """Each line of ORT's log with the phase it falls in: the child's ``MARK`` lines name phases,
    and each "Start another run" line inside one starts ``<phase>:run2``, ``:run3``... A phase's
    first line comes as ``None``."""
    phase, base, runs = "start", "start", 1
    for line in text.splitlines():
        if line.startswith(MARK):
            phase = base = line.split(maxsplit=1)[1].strip()
            runs = 1
            yield phase, None
        elif _ANOTHER_RUN in line:
            runs += 1
            phase = f"{base}:run{runs}"
            yield phase, None
        else:
            yield phase, line


def _is_run(phase: str) -> bool:
    """Whether ``phase`` is one of ORT's further runs inside a call (``<phase>:run2``...)."""
    last = phase.rsplit(":", 1)[-1]
    return last.startswith("run") and last[3:].isdigit()


def parse_arena_log(text: str) -> dict[str, dict[str, dict[str, int]]]:
    """Per phase (``tiny:step1``...) and arena name: bytes ``extended``, their ``count``, the
    ``largest`` single request and ``largest_extension`` (a power-of-two arena may add a 1 GiB
    region for a 64-byte request), bytes ``reserved`` (initializers), arenas ``created``. Where the
    session logs at INFO (``MPGRAPH_ORT_LOG_SEVERITY=1``), each further run ORT makes inside one
    call while it captures a CUDA graph is a phase of its own: ``model:step1``, then
    ``model:step1:run2``, ``model:step1:run3``."""
    phases: dict[str, dict[str, dict[str, int]]] = {}
    phase, arena = "start", "?"

    def slot(name: str) -> dict[str, int]:
        return phases.setdefault(phase, {}).setdefault(
            name, {"extended": 0, "count": 0, "largest": 0, "largest_extension": 0, "reserved": 0, "created": 0})

    for phase, line in _phased(text):
        if line is None:
            if _is_run(phase):  # a run that grows nothing is reported too
                phases.setdefault(phase, {})
        elif m := _EXTENDING.search(line):
            arena = m.group(1)
            slot(arena)["largest"] = max(slot(arena)["largest"], int(m.group(2)))
        elif m := _EXTENDED.search(line):
            slot(arena)["extended"] += int(m.group(1))
            slot(arena)["count"] += 1
            slot(arena)["largest_extension"] = max(slot(arena)["largest_extension"], int(m.group(1)))
        elif m := _RESERVING.search(line):
            slot(m.group(1))["reserved"] += int(m.group(2))
        elif m := _CREATING.search(line):
            slot(m.group(1))["created"] += 1
    return phases


_TOTAL = re.compile(r"Total allocated bytes: (\d+)")


def arena_instances(text: str) -> dict[str, dict[int, dict[str, int | str]]]:
    """Per phase (as ``parse_arena_log`` names them), each arena instance that grew: its bytes
    ``extended``, ``count`` and ``total`` after, keyed by its number in the log (1 = the first
    created). ORT names arenas only by device (every session's CUDA arena and the one for
    device values made from Python are all "Cuda"); an instance is told by its running total:
    each extension's "Total allocated bytes" line continues the instance whose total was that
    much less, and a first extension starts the newest created instance that has none yet."""
    phases: dict[str, dict[int, dict[str, int | str]]] = {}
    created: list[str] = []  # arena names in creation order
    totals: dict[int, int] = {}  # instance -> its total so far
    pending, name = 0, "?"
    for phase, line in _phased(text):
        if line is None:
            continue
        if m := _CREATING.search(line):
            created.append(m.group(1))
        elif m := _EXTENDING.search(line):
            name = m.group(1)
        elif m := _EXTENDED.search(line):
            pending = int(m.group(1))
        elif (m := _TOTAL.search(line)) and pending:
            total = int(m.group(1))
            match = [i for i, t in totals.items() if t == total - pending and created[i - 1] == name]
            if not match:
                fresh = [i for i in range(len(created), 0, -1) if i not in totals and created[i - 1] == name]
                match = fresh[:1] or [len(created) + 1]
                if match[0] > len(created):
                    created.append(name)
            inst = match[-1]
            totals[inst] = total
            row = phases.setdefault(phase, {}).setdefault(inst, {"arena": name, "extended": 0, "count": 0, "total": 0})
            row["extended"] = int(row["extended"]) + pending
            row["count"] = int(row["count"]) + 1
            row["total"] = total
            pending = 0
    return phases


def run_child(files: dict[str, str], pattern: str, args: argparse.Namespace, log: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model-file", files["model"],
           "--feeds", files["feeds"], "--tiny", files["tiny"], "--tiny-feeds", files["tiny_feeds"],
           "--pattern", pattern, "--steps", str(args.steps), "--provider", args.provider, "--log", str(log)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout, check=False)
    text = log.read_text(errors="replace") if log.exists() else ""
    if done.returncode != 0 or not done.stdout.strip():
        lines = (text + "\n" + done.stderr).strip().splitlines() or [""]
        tail = next((line for line in reversed(lines) if "Error" in line), lines[-1])
        return {"error": f"child exit {done.returncode}: {tail[:500]} (log: {log})"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["arena"] = parse_arena_log(text)
    return result


def estimate_parts(report: MemoryReport, pattern: bool) -> dict[str, int]:
    """The estimate as the measurement sees it: persistent and output buffers (the Trainer's two
    state sets and the batch), the first step's arena, and with the memory pattern its block."""
    parts = {"persistent": report.persistent_bytes, "outputs": report.output_bytes,
             "first_step_arena": report.first_step_arena_bytes,
             "pattern_block": report.pattern_block_bytes if pattern else 0}
    parts["total"] = sum(parts.values())
    parts["transient"] = report.transient_peak_bytes  # inside the first step's arena, not added
    return parts


def summarize(row: dict) -> dict:
    """Measured, fixed, own (measured - fixed) and the phase/arena numbers of one child."""
    tiny, model = row["result"]["tiny"], row["result"]["model"]
    steps = [k for k in model if k.startswith("step")]
    last = model[steps[-1]]
    arena = row["result"]["arena"]
    device = "Cuda" if row["provider"] == "cuda" else "Cpu"
    out = {
        "measured": last, "fixed": tiny[[k for k in tiny if k.startswith("step")][-1]],
        "init": model["init"], "step1": model["step1"], "step2": model.get("step2"),
        "after_tiny_delete": tiny["after_delete"],
        "arena_step1": arena.get("model:step1", {}).get(device, {}).get("extended", 0),
        "arena_step2": arena.get("model:step2", {}).get(device, {}).get("extended", 0),
        "arena_step2_largest": arena.get("model:step2", {}).get(device, {}).get("largest", 0),
        "arena_init": arena.get("model:init", {}).get(device, {}).get("extended", 0),
        "arena_later": arena.get("model:step3", {}).get(device, {}).get("extended", 0),
        "arenas_created": sorted({a for p in arena.values() for a, s in p.items() if s["created"]}),
    }
    out["arena_steps"] = out["arena_step1"] + out["arena_step2"] + out["arena_later"]
    if last is not None and out["fixed"] is not None:
        out["own"] = last - out["fixed"]
    return out


def _errors(estimate: int, got: int | None) -> str:
    """``estimate / got - 1`` and ``got / estimate - 1``."""
    if not got or not estimate:
        return f"{'-':>7s} {'-':>7s}"
    return f"{estimate / got - 1:+7.1%} {got / estimate - 1:+7.1%}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def print_row(row: dict, file=None) -> None:
    est = row["estimate"]
    head = f"{row['model']:10s} {row['policy']:6s} {row['pattern']:>4s} {row['batch']:5d} {est['total'] / MIB:9.1f}"
    if "result" not in row:
        parts = (f"  (persistent {_mib(est['persistent'])} + outputs {_mib(est['outputs'])} + first-step arena "
                 f"{_mib(est['first_step_arena'])} (transient peak {_mib(est['transient'])}) + pattern block "
                 f"{_mib(est['pattern_block'])})")
        print(head + ("  " + row["error"] if "error" in row else parts), file=file, flush=True)
        return
    s = row["summary"]
    own = s.get("own")
    steps = est["first_step_arena"] + est["pattern_block"]
    print(f"{head} {_mib(s['measured']):>9s} {_mib(s['fixed']):>7s} {_mib(own):>9s} {_errors(est['total'], own)}"
          f" {steps / MIB:9.1f} {_mib(s['arena_steps']):>9s} {_errors(steps, s['arena_steps'])}", file=file)
    print(f"    estimate: persistent {_mib(est['persistent'])} + outputs {_mib(est['outputs'])} + first-step arena "
          f"{_mib(est['first_step_arena'])} (transient peak {_mib(est['transient'])}) + pattern block "
          f"{_mib(est['pattern_block'])};  measured by phase: init "
          f"{_mib(s['init'])}, after step 1 {_mib(s['step1'])}, after step 2 {_mib(s['step2'])};  arena grew: "
          f"init {_mib(s['arena_init'])}, step 1 {_mib(s['arena_step1'])}, step 2 {_mib(s['arena_step2'])} "
          f"(largest request {_mib(s['arena_step2_largest'])}: ORT's pattern block), later {_mib(s['arena_later'])};  "
          f"kept after the tiny Trainer was deleted {_mib(s['after_tiny_delete'])}; model run "
          f"{row['result']['model_seconds']:.0f} s", file=file, flush=True)


HEADER = (f"{'model':10s} {'policy':6s} {'pat':>4s} {'batch':>5s} {'estimate':>9s} {'measured':>9s} {'fixed':>7s} "
          f"{'meas-fix':>9s} {'est/own':>7s} {'own/est':>7s} {'est steps':>9s} {'arena':>9s} {'est/ar':>7s} {'ar/est':>7s}"
          "\n(MiB; own = measured - fixed; est steps = first-step arena + pattern block; arena = what ORT's device arena "
          "grew by during the steps, from its log)")


def measure_all(args: argparse.Namespace) -> list[dict]:
    out = Path(args.out) if args.out else None
    if out:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="memory_check.") as tmp:
        return [row for name in args.models.split(",") for row in measure_model(name, args, Path(tmp), out)]


def measure_model(name: str, args: argparse.Namespace, work: Path, out: Path | None) -> list[dict]:
    """Every (policy, pattern) row of one model: estimates, and a child per measurement."""
    makers = {"zoo_gpt": (zoo_gpt, args.zoo_batch), "bench_gpt": (bench_gpt, args.bench_batch)}
    make, batch = makers[name]
    step, feeds = make(batch)
    tiny_step, tiny_feeds = tiny_mlp(TINY_BATCH)
    np.savez(work / "tiny_feeds.npz", **tiny_feeds)
    np.savez(work / f"{name}_feeds.npz", **feeds)
    rows = []
    for policy in args.policies.split(","):
        graph = convert(step, policy)
        report = estimate_memory(graph, batch=batch)
        files = {"feeds": str(work / f"{name}_feeds.npz"), "tiny_feeds": str(work / "tiny_feeds.npz"),
                 "model": str(work / f"{name}_{policy}.onnx"), "tiny": str(work / f"tiny_{policy}.onnx")}
        if not args.estimate_only:
            save_model(graph, files["model"], external_data=True)
            save_model(convert(tiny_step, policy), files["tiny"], external_data=False)
        for pattern in args.patterns.split(","):
            row = {"model": name, "policy": policy, "pattern": pattern, "batch": batch, "provider": args.provider,
                   "estimate": estimate_parts(report, pattern == "on"), "report": json.loads(report.to_json())}
            if not args.estimate_only:
                log = (out / "logs" if out else work) / f"{name}_{policy}_pattern-{pattern}.log"
                result = run_child(files, pattern, args, log)
                if "error" in result:
                    row["error"] = result["error"]
                else:
                    row["result"] = result
                    row["summary"] = summarize(row)
            print_row(row)
            rows.append(row)
        for path in (files["model"], files["model"] + ".data"):
            Path(path).unlink(missing_ok=True)
    return rows


# -- ORT CPU, peak RSS (the liveness check on a machine without a GPU) --------------------------------

_CPU_CHILD = r"""
import ctypes, resource, sys, numpy as np, onnxruntime as ort
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
model = open(sys.argv[1], "rb").read()
feeds = dict(np.load(sys.argv[2]))
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.enable_cpu_mem_arena = sys.argv[3] == "arena"
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
# Session creation has its own transient peak: give freed memory back, reset the high-water mark
# (clear_refs 5, Linux >= 4.0), and measure what the steps add on top of the loaded session.
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
for _ in range(2):
    session.run(None, feeds)
print(status("VmHWM") - before)
"""


def measure_cpu(step: ir.Model, feeds: dict[str, np.ndarray], arena: bool) -> int:
    """Peak resident bytes two steps add to a loaded ORT CPU session for ``step`` (fresh process):
    the run's share of the estimate is outputs + transient peak (the weights are loaded before)."""
    with tempfile.TemporaryDirectory() as tmp:
        model, data = Path(tmp) / "step.onnx", Path(tmp) / "feeds.npz"
        model.write_bytes(ir.to_proto(step).SerializeToString())
        np.savez(data, **feeds)
        # A fixed mmap threshold: glibc otherwise raises it as buffers are freed and serves later
        # large buffers from the heap, where freed memory stays resident (noisy, 30% swings).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run([sys.executable, "-c", _CPU_CHILD, str(model), str(data), "arena" if arena else "no-arena"],
                             capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def rss_check(args: argparse.Namespace) -> None:
    makers = {"zoo_gpt": (zoo_gpt, args.zoo_batch), "bench_gpt": (bench_gpt, args.bench_batch)}
    print(f"{'model':10s} {'policy':6s} {'batch':>5s} {'params':>11s} {'estimate MiB':>13s} {'measured MiB':>13s} "
          f"{'error':>7s}  (estimate: outputs + transient peak, vs the RSS two steps add)")
    for name in args.models.split(","):
        make, batch = makers[name]
        step, feeds = make(batch)
        report = estimate_memory(step, batch=batch)
        got = measure_cpu(step, feeds, args.cpu_arena) / MIB
        estimate = (report.output_bytes + report.transient_peak_bytes) / MIB
        print(f"{name:10s} {'fp32':6s} {batch:5d} {report.parameters:11,d} {estimate:13.1f} {got:13.1f} "
              f"{estimate / got - 1:+7.1%}  (persistent {report.persistent_bytes / MIB:.1f}, outputs "
              f"{report.output_bytes / MIB:.1f}, transient {report.transient_peak_bytes / MIB:.1f}, saved for "
              f"backward {report.saved_for_backward_bytes / MIB:.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="zoo_gpt,bench_gpt")
    parser.add_argument("--policies", default="fp32,bf16")
    parser.add_argument("--patterns", default="on,off", help="ORT memory pattern settings to measure (on is ORT's default).")
    parser.add_argument("--zoo-batch", type=int, default=256)
    parser.add_argument("--bench-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same procedure on ORT CPU (arena logs only, no device memory): a dry run.")
    parser.add_argument("--out", help="Folder for memory_check.txt, memory_check.json and the ORT logs.")
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--estimate-only", action="store_true", help="Print the estimates; run nothing.")
    parser.add_argument("--cpu", action="store_true",
                        help="Float32 on ORT CPU instead: peak RSS two steps add to a loaded session (fresh process).")
    parser.add_argument("--cpu-arena", action="store_true", help="With --cpu: keep ORT's CPU arena (off by default).")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model-file", "--feeds", "--tiny", "--tiny-feeds", "--pattern", "--log"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
    elif args.cpu:
        rss_check(args)
    else:
        start = time.perf_counter()
        rows = measure_all(args)
        versions = next((r["result"]["versions"] for r in rows if "result" in r), {})
        footer = f"({time.perf_counter() - start:.0f} s; {versions})"
        print(footer)
        if args.out:
            Path(args.out, "memory_check.json").write_text(json.dumps(rows, indent=1, default=str))
            with open(Path(args.out, "memory_check.txt"), "w") as f:
                print(f"# python3 benchmarks/memory_check.py {' '.join(sys.argv[1:])}   {footer}", file=f)
                print(HEADER, file=f)
                for row in rows:
                    print_row(row, file=f)


if __name__ == "__main__":
    main()
