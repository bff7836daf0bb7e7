"""``mpgraph audit --memory``: bytes per parameter by role, and activation memory by liveness."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from mpgraph.cli.console import console

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["memory_report", "step_graph_for"]


def step_graph_for(model: Path, optimizer: str | None, policy: str | None) -> ir.Model:
    """The training step graph to estimate: ``model`` itself when it is one, else built from it.

    A forward model gets ``train-graph`` with ``optimizer`` (default ``adamw``), then
    ``convert`` with ``policy`` when given; a float32 step graph is converted with ``policy``.
    """
    from mpgraph._ir import meta as md
    from mpgraph._ir.contract import StepContract
    from mpgraph.convert import convert
    from mpgraph.errors import MpgraphError
    from mpgraph.io import load_model
    from mpgraph.training import build_training_graph

    loaded = load_model(model)
    props = loaded.metadata_props
    if not StepContract.is_training(loaded):
        if md.MODEL_POLICY in props:
            raise MpgraphError(f"{model}: a converted forward model; give the float32 forward model (with "
                               "--optimizer and --policy) or a training step graph")
        step = build_training_graph(loaded, optimizer=optimizer or "adamw")
    else:
        if optimizer is not None:
            raise MpgraphError(f"{model}: already a training step graph (its optimizer is fixed); drop --optimizer")
        step = loaded
    if policy is not None:
        if md.MODEL_POLICY in step.metadata_props:
            raise MpgraphError(f"{model}: already converted with policy {step.metadata_props[md.MODEL_POLICY]}; drop --policy")
        step = convert(step, policy)
    return step


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory_report(model: Path, *, batch: int, optimizer: str | None, policy: str | None, as_json: bool,
                  pipelined: bool = False, nproc: int | None = None, shard_optimizer: bool = False,
                  inplace: bool = False) -> None:
    """Print ``estimate_memory`` for ``model`` (table or JSON); ``pipelined``: for a pipelined
    CUDA trainer (three state sets); ``nproc``: also the bytes per rank (``_rank_report``)."""
    from mpgraph.audit.memory import ROLES, estimate_memory
    from mpgraph.errors import UsageError

    if batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}")
    if shard_optimizer and nproc is None:
        raise UsageError("--shard-optimizer: only with --nproc N (the bytes per rank)")
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    step = step_graph_for(model, optimizer, policy)
    report = estimate_memory(step, batch=batch, state_sets=3 if pipelined else 2, inplace=inplace)
    if as_json:
        text = report.to_json() if nproc is None else _with_ranks(report.to_json(), step, nproc, shard_optimizer)
        sys.stdout.write(text + "\n")
        return
    console.print(f"[bold]{model}[/]  policy={report.policy or 'float32 (not converted)'}  batch={batch}  "
                  f"parameters={report.parameters:,}", highlight=False, soft_wrap=True)
    table = Table(title="bytes per parameter, by role", show_footer=True)
    table.add_column("role", footer="total")
    table.add_column("bytes/param", justify="right", footer=f"{sum(report.bytes_per_parameter.values()):.2f}")
    table.add_column("total", justify="right", footer=_mib(sum(report.role_bytes.values())))
    for role in ROLES:
        table.add_row(role.replace("_", " "), f"{report.bytes_per_parameter[role]:.2f}", _mib(report.role_bytes[role]))
    console.print(table)
    rows = [
        ("activations kept for the backward", report.saved_for_backward_bytes,
         f"{report.saved_for_backward_values} forward buffers read by backward nodes"),
        ("transient peak (liveness)", report.transient_peak_bytes, f"at {report.transient_peak_node}"),
        ("data inputs", report.data_bytes, ""),
        ("other state", report.other_state_bytes, "running statistics, loss scale, step counter"),
        ("constants", report.constant_bytes, ""),
        *([("fp8 operands", report.fp8_bytes["values"], "1 byte an element, in the transient figures"),
           ("fp8 scale state", report.fp8_bytes["state"], "scales and amax histories, in other state")]
          if report.fp8_bytes else []),
        ("output buffers", report.output_bytes, "updated state bound to a second set of buffers"),
        *([("state updated in place", report.inplace_bytes,
            f"no second buffer (--inplace); {len(report.inplace_refused)} values keep one")] if inplace else []),
        *([("third state set", report.extra_state_set_bytes, "a pipelined CUDA trainer's (--pipelined)")]
          if pipelined else []),
        ("first step's arena", report.first_step_arena_bytes, "step 1's buffers in ORT's arena (kSameAsRequested), with its gaps"),
        ("ORT memory-pattern block", report.pattern_block_bytes, "from step 2, beside step 1's buffers (ORT's default)"),
        ("estimated peak", report.estimated_peak_bytes, "persistent + outputs + extra state sets + first step's arena + pattern block"),
        ("  without the pattern", report.peak_without_pattern_bytes, "SessionOptions.enable_mem_pattern = False"),
    ]
    extra = Table(title=f"one step at batch {batch}")
    for col in ("what", "bytes", "note"):
        extra.add_column(col)
    for what, n, note in rows:
        extra.add_row(what, _mib(n), note)
    console.print(extra)
    console.print("note: not counted: the provider's own workspaces and libraries (ORT CUDA 1.31 on an H200: "
                  "about 150 MiB a process, benchmarks/results/memory_check_cuda_2026-12-01T05.txt)", highlight=False)
    if report.unknown_shapes:
        console.print(f"note: {report.unknown_shapes} intermediate values have no inferred shape and are not counted",
                      highlight=False)
    if nproc is not None:
        _rank_report(step, nproc, shard_optimizer)


def _with_ranks(text: str, step: ir.Model, nproc: int, shard_optimizer: bool) -> str:
    """The JSON report with ``ranks``: a list of ``audit.rank_memory`` records and their totals."""
    import dataclasses
    import json

    from mpgraph.audit.rank_memory import rank_memory

    ranks = rank_memory(step, nproc, shard_optimizer=shard_optimizer)
    return json.dumps({**json.loads(text), "ranks": [{**dataclasses.asdict(r), "total": r.total} for r in ranks]})


def _rank_report(step: ir.Model, nproc: int, shard_optimizer: bool) -> None:
    """``audit --memory --nproc N``: what each rank of a data-parallel run holds (``audit.rank_memory``)."""
    from mpgraph.audit.rank_memory import rank_memory

    ranks = rank_memory(step, nproc, shard_optimizer=shard_optimizer)
    table = Table(title=f"bytes per rank, {nproc} processes{', optimizer state sharded (ZeRO-1)' if shard_optimizer else ''}")
    for col in ("rank", "master weights", "optimizer state", "state outputs", "gradient buckets", "receive buffers",
                "total"):
        table.add_column(col, justify="right")
    for r in ranks:
        table.add_row(str(r.rank), *(_mib(n) for n in (r.master_weights, r.optimizer_state, r.state_outputs,
                                                        r.gradient_buckets, r.receive_buffers, r.total)))
    console.print(table)
    console.print(f"note: activations per rank are those of one process at batch / {nproc}", highlight=False)
