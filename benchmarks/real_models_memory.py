"""``real_models.py``'s run state and its fresh-process memory children: ``Bench`` keeps every
row's Run, writes the JSON and measures each configuration's peak memory in a child process
(``real_models.py --memory-child SPEC``); ``memory_child`` is that child's side.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import functools
import json
import os
import pathlib
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from real_models_cases import (
    BATCHES,
    COMPILE_MODES,
    MEMORY_STEPS,
    ModelCase,
    build_case,
    fingerprint,
    log,
    mpgraph_run,
    torch_rows,
)
from real_models_tables import (
    derived,
    row_record,
)
from step_timing import (
    Run,
    error_line,
    host_rss_mib,
    kernel_breakdown,
    peak_over_steps,
    reset_host_peak,
    write_json,
)

#: The memory children re-invoke the script: ``real_models.py --memory-child SPEC``.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_models.py")


# -- the run ------------------------------------------------------------------------------


class Bench:
    """Keeps every row's Run (mpgraph's without their trainers once timed) and writes the JSON."""

    def __init__(self, args: argparse.Namespace, header: dict[str, Any], cuda: bool) -> None:
        self.args, self.cuda = args, cuda
        self.result: dict[str, Any] = {"env": header, "args": {**vars(args), "models": args.models,
                                                               "exporters": args.exporters},
                                       "rows": [], "prep": [], "skipped": []}
        self.entries: list[tuple[str, str | None, Run]] = []
        self.kernels: dict[int, dict[str, Any]] = {}
        self.flops: dict[str, float] = {}
        self.kernels_thread = _build_kernels() if cuda else None
        # Each configuration's peak memory in its own fresh process (``memory_in_child``).
        self.child_memory = args.child_memory == "on" or (args.child_memory == "auto" and cuda)
        self.workdir = ""  # set by _run: step graphs, batches, the children's specs and logs
        self.children: futures.ThreadPoolExecutor | None = None
        self.pending: list[futures.Future[None]] = []
        self.child_count = 0
        self.leftovers: list[str] = []

    def batches_file(self, case: ModelCase) -> str:
        """The model's batches in one ``.npz`` (``{i}.{key}``), for the mpgraph memory children."""
        path = os.path.join(self.workdir, f"{case.name}_batches.npz")
        if not os.path.exists(path):
            np.savez(path, **{f"{i}.{k}": v for i, b in enumerate(case.batches) for k, v in b.items()})
        return path

    def kernels_ready(self) -> None:
        if self.kernels_thread is not None:
            self.kernels_thread.join()
            self.kernels_thread = None

    def rows(self) -> list[dict[str, Any]]:
        rows = [row_record(m, e, run, self.args.check_step, self.kernels.get(id(run)),
                           self.flops.get(m) if run.device == "cuda" else None) for m, e, run in self.entries]
        derived(rows, self.args.check_step)
        return rows

    def write(self) -> None:
        self.result["rows"] = self.rows()
        write_json(os.path.join(self.args.out, "real_models.json"), self.result)

    def memory_in_child(self, run: Run, model: str, spec: Mapping[str, Any]) -> None:
        """Starts measuring ``run.peak``: ``peak_over_steps`` of the configuration in a fresh
        process (``--memory-child``, through ``trainer_memory.run_child``), one child at a time,
        in the background while this process builds step graphs on the CPU. Each child makes
        torch's CUDA context first and takes its baseline after it, so the context is counted
        alike for torch and ORT, and no configuration pays for another's one-time costs or
        inherits memory another freed. The device is shared: this process must not allocate or
        free device memory while a child runs, so everything that does calls ``settle`` first."""
        if not self.child_memory or run.error:
            return
        if self.children is None:
            self.children = futures.ThreadPoolExecutor(1, thread_name_prefix="memory-child")
        tag = f"memory_{self.child_count}_{model}_{run.label.replace(' ', '_')}"
        self.child_count += 1
        spec = {**spec, "label": run.label, "model": model, "small": self.args.small, "seed": self.args.seed,
                "device": run.device, "twin": run.twin, "steps": MEMORY_STEPS,
                "log": os.path.join(self.workdir, f"{tag}.log")}
        self.pending.append(self.children.submit(self._child, run, tag, spec))

    def _child(self, run: Run, tag: str, spec: dict[str, Any]) -> None:
        import trainer_memory

        spec_path, log_path = os.path.join(self.workdir, f"{tag}.json"), spec["log"]
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        t = time.perf_counter()
        cmd = [sys.executable, SCRIPT, "--memory-child", spec_path]
        try:
            peak = trainer_memory.run_child(cmd, pathlib.Path(log_path), self.args.child_timeout)
        except Exception as e:  # noqa: BLE001 - the row says why it has no peak
            peak = {"error": error_line(e)}
        peak["seconds"] = time.perf_counter() - t
        if "error" in peak and os.path.exists(log_path):  # keep the log of a failed child
            kept = os.path.join(self.args.out, f"{tag}.log")
            shutil.copy(log_path, kept)
            peak["error"] = peak["error"].replace(log_path, kept)
        run.peak = peak
        what = "device memory" if run.device == "cuda" else "host RSS"
        log(f"{spec['model']} {run.label}: " + (f"memory child failed: {peak['error']}" if "error" in peak else
            f"peak {peak['peak_mib'] / 1024:.2f} GiB {what} in a fresh process ({peak['seconds']:.0f} s)"))

    def settle(self) -> None:
        """Wait for the memory children (see ``memory_in_child``)."""
        for future in self.pending:
            future.result()
        self.pending.clear()
        for leftover in self.leftovers:  # step graphs the children no longer need
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        self.leftovers.clear()

    def profile(self, runs: Sequence[Run]) -> None:
        if not self.cuda or self.args.no_profile:
            return
        for run in runs:
            if run.error or id(run) in self.kernels or run.device != "cuda":
                continue
            try:
                self.kernels[id(run)] = kernel_breakdown(run, steps=2)
            except Exception as e:  # noqa: BLE001
                self.kernels[id(run)] = {"error": error_line(e)}
                continue
            log(f"{run.label}: the kernels that take the most time per step")
            for k in self.kernels[id(run)]["top"][:12]:
                log(f"    {k['ms']:6.2f} ms {k['per_step']:5.0f}x  {k['kernel']}")


def memory_child(spec_path: str) -> None:
    """``--memory-child``: one configuration's ``peak_over_steps`` in this fresh process, one JSON
    line on stdout. torch makes the CUDA context first (``trainer_memory.child_setup``) and the
    baseline is taken after it and after the model and batches are on the host: device memory
    over it on CUDA, the resident set's high-water mark over it on the CPU (a dry run's check of
    this path, not a device number). The torch rows are the parent's (``torch_rows``) from the
    same seeded weights (checked by fingerprint); the mpgraph rows load the parent's step graph."""
    import trainer_memory

    with open(spec_path) as f:
        spec = json.load(f)
    cuda = spec["device"] == "cuda"
    trainer_memory.child_setup(spec["log"], cuda)
    warnings.simplefilter("ignore")
    if spec["graph"]:
        with np.load(spec["batches"]) as saved:
            batches: list[dict[str, np.ndarray]] = [{} for _ in range(BATCHES)]
            for key in saved.files:
                i, name = key.split(".", 1)
                batches[int(i)][name] = saved[key]
        case = ModelCase(spec["model"], torch.nn.Module(), batches, 0.0)
        make = functools.partial(mpgraph_run, spec["label"], spec["graph"], case, spec["device"], spec["twin"])
    else:
        case = build_case(spec["model"], spec["small"], spec["seed"])
        if fingerprint(case.module) != spec["fingerprint"]:
            raise SystemExit("the memory child built other weights than the parent")
        make = dict(torch_rows(case, cuda, tuple(COMPILE_MODES)))[spec["label"]]
        if spec["label"] in COMPILE_MODES.values():
            import torch._inductor.config as inductor

            # In this process: Inductor's worker pool would be other processes on the device.
            # The parent compiled the same graphs, so its cache (compile_threads is not in the
            # key) serves them.
            inductor.compile_threads = 1
    if cuda:
        base = trainer_memory.used_since(0)
        used = lambda: trainer_memory.used_since(base) / 2**20  # noqa: E731
    else:
        reset_host_peak()
        base = host_rss_mib()
        used = lambda: host_rss_mib(peak=True) - base  # noqa: E731
    out = peak_over_steps(make, spec["steps"], used, mark=lambda p: os.write(2, f"{trainer_memory.MARK} {p}\n".encode()))
    out["measure"] = "device memory (cudaMemGetInfo)" if cuda else "host resident set high-water mark"
    if cuda and not spec["graph"]:
        out["torch_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["torch_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    print(json.dumps(out), flush=True)
    os._exit(0)  # the result is out: no teardown of ORT's and torch's CUDA state to fail the exit code


def _build_kernels() -> threading.Thread:
    """mpgraph's CUDA kernel library is built (nvcc, a minute on a fresh machine) while the
    first models are exported; the first Trainer then finds it cached."""
    def build() -> None:
        try:
            from mpgraph import lowering as kernels

            kernels.library("cuda")
        except Exception as e:  # noqa: BLE001 - the Trainer reports why it runs without them
            log(f"kernel library: {error_line(e)}")

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    return thread
