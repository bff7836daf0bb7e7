"""Device memory of a CUDA ``Trainer`` as it runs by default (CUDA graphs), by phase, with the state
in two buffer sets and updated in place, next to ``estimate_memory`` of the session it captured.

For one step graph (``--graph``, or ``--model gpt2`` built as ``real_models.py`` builds it: HF
GPT-2 small, TorchScript export, bf16, CUDA target, batch 8, T 1024), each configuration runs in
a fresh process (ORT keeps its arenas per process):

- ``before``: the Trainer as it ran before in-place updates: two buffer sets
  (``inplace_state=False``) and ORT's arena growing to the next power of two
  (``arena_extend_strategy=kNextPowerOfTwo``, ORT's default);
- ``two-sets``: two sets, the Trainer's arena growth now (``kSameAsRequested``);
- ``inplace-pow2``: in place, ``kNextPowerOfTwo``;
- ``after``: the Trainer's defaults now (in place on CUDA for a state over 512 MiB,
  ``kSameAsRequested``);
- ``no-graph``: the defaults without CUDA graphs (``cuda_graph=False``): what capture adds.

With ``MPGRAPH_ORT_LOG_SEVERITY=1`` in the environment the sessions log ORT's "Start another
run" lines, and step 1's growth is split by the runs ORT makes inside that call while it
captures (two uncaptured runs, then the captured one). Step 1's growth is also split by arena
instance (``memory_check.arena_instances``): each session has its own CUDA arena, and device values
made from Python (the state sets, the captured step's loss and batch buffers) have another; the
log calls them all "Cuda". ViT's extra 1 GiB (2026-12-03T12) was found in that log by hand; the split shows such growth directly.

It prints device memory in use (``cudaMemGetInfo`` through torch) over what the process held
before anything of ORT existed: after the Trainer is made, after each step; how much ORT's device
arena grew in each phase (its INFO log, ``memory_check.parse_arena_log``), so arena and
non-arena memory (CUDA libraries' handles and workspaces, the fused attention's workspace) are
told apart; and the estimate for the same session (``estimate_memory`` on the capturing session's
plan, ``recorded_shapes=True``, with the configuration's in-place and arena settings): persistent +
outputs + first-step arena (that session has no memory pattern).

Run on the GPU machine from the repository root::

    python3 benchmarks/trainer_memory.py --model gpt2 --out results/trainer_memory_gpt2
    python3 benchmarks/trainer_memory.py --model vit --exporter dynamo --configs after,no-graph
    python3 benchmarks/trainer_memory.py --graph STEP.onnx --configs before,after
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_check import MARK, arena_instances, parse_arena_log  # noqa: E402

POW2 = {"arena_extend_strategy": "kNextPowerOfTwo"}
CONFIGS = {
    "before": {"inplace_state": False, "provider_options": POW2},
    "two-sets": {"inplace_state": False},
    "inplace-pow2": {"inplace_state": True, "provider_options": POW2},
    "after": {},
    "no-graph": {"cuda_graph": False},
}
GIB = 2**30


def feeds_for(program, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random data for every data input: class labels and token ids within their bounds."""
    rng = np.random.default_rng(seed)
    labels = program.label_bounds()
    feeds = {}
    for spec in program.data_inputs:
        shape = tuple(d if isinstance(d, int) else batch for d in (spec.shape or (batch,)))
        if np.issubdtype(spec.dtype, np.integer):
            high = labels[spec.name][0] if spec.name in labels else (program.vocab(spec.name) or 2)
            feeds[spec.name] = rng.integers(0, high, shape).astype(spec.dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return feeds


def used_since(before: int) -> int:
    """Bytes of device memory in use (``cudaMemGetInfo``, every process's) over ``before``."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - before


def child_setup(log: str, cuda: bool = True) -> int:
    """A measuring child's start: its stderr (ORT's log) goes to ``log``, ORT logs at INFO (its
    arenas log every extension, see ``run_child``), and on CUDA torch makes the CUDA context
    first, so every child counts it alike. Returns the device memory in use then (0 on CPU)."""
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
    from mpgraph.runtime import providers

    providers.set_default_logger_severity(1)
    if not cuda:
        return 0
    import torch

    torch.cuda.init()
    return used_since(0)


def _estimate(trainer, config: dict) -> dict[str, int]:
    from mpgraph.audit.memory import estimate_memory
    from mpgraph.io import as_model

    arena = trainer.provider_options["arena_extend_strategy"]
    report = estimate_memory(as_model(trainer.executor.plan.graph), recorded_shapes=True,
                             inplace=bool(trainer.inplace), arena=arena)
    return {"persistent": report.persistent_bytes, "outputs": report.output_bytes,
            "arena": report.first_step_arena_bytes, "transient": report.transient_peak_bytes,
            "inplace": report.inplace_bytes, "total": report.peak_without_pattern_bytes,
            "cuda_state_arena": report.cuda_state_arena_bytes}


def child(args: argparse.Namespace) -> None:
    """One configuration in this fresh process; one JSON line on stdout."""
    before = child_setup(args.log)
    from mpgraph.runtime.trainer import Trainer

    config = CONFIGS[args.config]
    os.write(2, f"{MARK} model:init\n".encode())
    trainer = Trainer(args.graph, "cuda", **config)
    out = {"init": used_since(before), "inplace_values": len(trainer.inplace), "pairs": len(trainer.pairs),
           "inplace_reason": trainer.inplace_reason, "pipeline": trainer.pipeline}
    feeds = feeds_for(trainer.program, args.batch)
    for i in range(1, args.steps + 1):
        os.write(2, f"{MARK} model:step{min(i, 3)}\n".encode())
        out[f"loss{i}"] = trainer.step(feeds).loss
        out[f"step{i}"] = used_since(before)
    out["cuda_graph"], out["estimate"] = trainer.cuda_graph, _estimate(trainer, config)
    del trainer
    gc.collect()
    print(json.dumps(out), flush=True)


def run_config(config: str, graph: str, args: argparse.Namespace, logs: Path) -> dict:
    log = logs / f"{config}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", config, "--graph", graph,
           "--batch", str(args.batch), "--steps", str(args.steps), "--log", str(log)]
    return run_child(cmd, log, args.child_timeout)


def run_child(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run a measuring child (``child_setup``: its stderr in ``log``; its result the last JSON line
    on its stdout): that result with ``arena_grew``, the bytes ORT's CUDA arenas grew by per
    phase (the child's ``MARK`` lines), or ``{"error": ...}`` with the log's last line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s (log: {log})"}
    if done.returncode != 0 or not done.stdout.strip():
        text = log.read_text(errors="replace") if log.exists() else done.stderr
        return {"error": f"exit {done.returncode}: {(text.strip().splitlines() or [''])[-1][:400]} (log: {log})"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    text = log.read_text(errors="replace")
    arena = parse_arena_log(text)
    result["arena_instances"] = {phase: {str(i): row for i, row in rows.items()}
                                 for phase, rows in arena_instances(text).items()}
    result["arena_grew"] = {phase: sum(a["extended"] for name, a in arenas.items() if name.startswith("Cuda"))
                            for phase, arenas in arena.items()}
    result["arena_log"] = arena
    return result


def build_step(workdir: str, model: str = "gpt2", exporter: str = "torchscript") -> str:
    """The bf16 step graph of one of ``real_models.py``'s models, built as it builds it."""
    import real_models as rm

    job = rm.PrepJob(model=model, exporter=exporter, small=False, seed=0, policies=("bf16",), emulate=False,
                     target="cuda", workdir=workdir)
    built = rm.prepare(job)
    if "bf16" not in built["graphs"]:
        raise SystemExit(f"could not build {model}'s bf16 step graph: {built['errors']}")
    return built["graphs"]["bf16"]


def report(config: str, r: dict) -> str:
    if "error" in r:
        return f"{config:13s} {r['error']}"
    steps = [k for k in r if k.startswith("step")]
    est, grew = r["estimate"], r["arena_grew"]
    g = lambda b: f"{b / GIB:6.2f}"  # noqa: E731
    return (f"{config:13s} init {g(r['init'])}  after steps {' '.join(g(r[s]) for s in steps)} GiB  "
            f"(arena grew: init {g(grew.get('model:init', 0))}, step 1 {g(grew.get('model:step1', 0))}, "
            f"later {g(grew.get('model:step2', 0) + grew.get('model:step3', 0))});  estimate {g(est['total'])} = "
            f"persistent {g(est['persistent'])} + outputs {g(est['outputs'])} + arena {g(est['arena'])}; the state "
            f"sets in onnxruntime's Python CUDA arena {g(est['cuda_state_arena'])} "
            f"(transient peak {g(est['transient'])});  in place {r['inplace_values']}/{r['pairs']} values "
            f"({g(est['inplace'])} GiB) {r['inplace_reason']};  cuda_graph {r['cuda_graph']};  "
            f"loss {r.get('loss1', float('nan')):.4f};  step 1's arena extensions: {_extensions(r, 'model:step1')}"
            f"{_by_run(grew)}{_by_instance(r, 'model:step1')}")


def _by_instance(r: dict, phase: str) -> str:
    """``phase``'s growth by CUDA arena instance (``memory_check.arena_instances``: numbered in the
    order the log creates them; the sessions' arenas and the one of device values made from
    Python all say "Cuda"), each with its total after."""
    rows = {i: row for i, row in (r.get("arena_instances") or {}).get(phase, {}).items()
            if row["arena"] == "Cuda" and row["extended"]}
    if not rows:
        return ""
    return ";  step 1 by CUDA arena: " + ", ".join(
        f"#{i} +{row['extended'] / GIB:.2f} GiB in {row['count']}x (total {row['total'] / GIB:.2f})"
        for i, row in sorted(rows.items(), key=lambda kv: int(kv[0])))


def _by_run(grew: dict[str, int]) -> str:
    """Step 1's growth by ORT's runs inside the call (the phases ``parse_arena_log`` splits off
    where the session logs at INFO), or nothing where it was not split."""
    runs = sorted((p for p in grew if p.startswith("model:step1:run")), key=lambda p: int(p.rsplit("run", 1)[1]))
    if not runs:
        return ""
    parts = [f"run1 {grew.get('model:step1', 0) / GIB:.2f}"] + [f"{p.rsplit(':', 1)[1]} {grew[p] / GIB:.2f}" for p in runs]
    return ";  step 1 by ORT run: " + ", ".join(parts) + " GiB"

def _extensions(r: dict, phase: str) -> str:
    """How many times ORT's CUDA arenas grew in ``phase``, the largest request that made one grow and
    the largest growth (not the same: a power-of-two arena grows by a region for a small request)."""
    arenas = {n: a for n, a in (r.get("arena_log") or {}).get(phase, {}).items() if n.startswith("Cuda")}
    if not arenas:
        return "none logged"
    return ", ".join(f"{n} {a['count']}x (largest request {a['largest'] / 2**20:.0f} MiB, largest extension "
                     f"{a.get('largest_extension', 0) / 2**20:.0f} MiB)" for n, a in arenas.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", help="A step graph (default: build --model's, as real_models.py does).")
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "llama", "bert", "vit"))
    parser.add_argument("--exporter", default="torchscript", choices=("torchscript", "dynamo"))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--batch", type=int, default=8, help="For symbolic batch dims (GPT-2's are static: 8).")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="Folder for trainer_memory.json and the ORT logs.")
    parser.add_argument("--child-timeout", type=int, default=900)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="trainer_memory.") as tmp:
        out = Path(args.out or tmp)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        graph = args.graph or build_step(tmp, args.model, args.exporter)
        print(f"# {graph}: device memory over the process's before ORT (GiB)", flush=True)
        rows = {}
        for config in args.configs.split(","):
            rows[config] = run_config(config, graph, args, out / "logs")
            print(report(config, rows[config]), flush=True)
        print(f"({time.perf_counter() - start:.0f} s)")
        if args.out:
            (out / "trainer_memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
