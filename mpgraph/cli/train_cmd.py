"""``mpgraph train``: run a training step graph on a dataset with a progress bar.

Everything that can fail before the first step (numbers, output paths, model, provider,
dtype on that provider, dataset and its labels, resume checkpoint) is checked first, so a run
that cannot start writes nothing and leaves an existing checkpoint as it was.

A run never loses its work (``mpgraph.runtime.trainer.run_training``):

1. SIGINT (Ctrl-C) and SIGTERM (schedulers, ``docker stop``) finish the step in flight, then
   write the checkpoint, metrics and plot, and exit 130 / 143; ``--resume`` continues bit for
   bit. A second signal stops at once without writing (the last checkpoint is kept).
2. A checkpoint that cannot be written (a full disk) keeps the last good one and says which
   step it holds; at ``--checkpoint-every`` the run goes on (one warning, and one line at the
   end that counts the later failures); at the end it is an error, after the metrics, the
   plot and the summary are written as usual.
3. Non-finite data or a non-finite loss stops the run at that step (``--on-nonfinite stop``,
   the state checkpointed is that of the last good step) or skips the step (``skip``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mpgraph.cli.paths import output_path
from mpgraph.errors import MpgraphError

if TYPE_CHECKING:
    from mpgraph.data import Dataset
    from mpgraph.runtime.metrics import StepResult
    from mpgraph.runtime.options import RunOptions
    from mpgraph.runtime.trainer import Trainer

__all__ = ["train"]


def _check_args(step: Path, steps: int, batch: int | None, checkpoint_every: int, threads: int | None, lr: float | None,
                on_nonfinite: str, checkpoint: Path | None, metrics: Path | None, plot: Path | None) -> None:
    """Refuse bad numbers and output paths before any work starts."""
    from mpgraph.cli.checks import check_output_path, finite, positive_int
    from mpgraph.errors import UsageError
    from mpgraph.io import clean_stale_temporaries
    from mpgraph.runtime.checkpoint import metrics_path
    from mpgraph.runtime.trainer import NONFINITE_MODES

    positive_int(steps, "--steps", minimum=0)
    if batch is not None:
        positive_int(batch, "--batch")
    positive_int(checkpoint_every, "--checkpoint-every", minimum=0)
    if threads is not None:
        positive_int(threads, "--threads")
    if lr is not None:
        finite(lr, "--lr", low=0.0)
    if on_nonfinite not in NONFINITE_MODES:
        raise UsageError(f"--on-nonfinite: invalid value '{on_nonfinite}'; valid: {', '.join(NONFINITE_MODES)}")
    if plot is not None and plot.suffix.lower() != ".png":
        raise UsageError(f"--plot {plot}: must end in .png")
    if metrics is not None and metrics.suffix.lower() not in (".csv", ".json"):
        raise UsageError(f"--metrics {metrics}: must end in .csv or .json")
    outputs = [p.resolve() for p in (checkpoint, metrics, plot) if p is not None]
    if len(set(outputs)) != len(outputs):
        raise UsageError("--checkpoint, --metrics and --plot must name different files")
    if checkpoint is not None and step.exists() and checkpoint.resolve() == step.resolve():
        raise UsageError(f"--checkpoint {checkpoint}: is the step graph itself")
    history = metrics_path(checkpoint) if checkpoint is not None else None
    for path, what in ((checkpoint, "checkpoint"), (metrics, "metrics"), (plot, "plot"), (history, "checkpoint")):
        if path is not None:
            check_output_path(path, f"--{what}")  # a real probe file, so no step runs in vain
            clean_stale_temporaries(path)


def _stream(trainer: Trainer, batch: int | None, seed: int | None, resume: Path | None) -> tuple[int, int]:
    """``--batch`` and ``--seed`` resolved (``Trainer.stream_settings``); a note names the
    checkpoint's values a resume takes."""
    from mpgraph.cli.console import err_console

    resolved = trainer.stream_settings(batch, seed)
    taken = [f"{flag} {value}" for flag, given, value in (("--batch", batch, resolved[0]), ("--seed", seed, resolved[1]))
             if given is None]
    if resume is not None and taken:
        err_console.print(f"note: resuming with the checkpoint's {' and '.join(taken)}", highlight=False, soft_wrap=True)
    return resolved


def _provider_options(items: list[str] | None) -> dict[str, str]:
    """``--provider-option KEY=VALUE`` flags as a dict."""
    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise MpgraphError(f"--provider-option {item!r}: expected KEY=VALUE")
        options[key] = value
    return options


def _open_trainer(step: Path, options: RunOptions) -> Trainer:
    """The trainer of ``step``, its notes printed; an ORT failure to load is one line."""
    from mpgraph.cli.console import err_console
    from mpgraph.runtime.providers import ort_error
    from mpgraph.runtime.trainer import Trainer

    try:
        trainer = Trainer(step, options=options)
    except MpgraphError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT raises RuntimeError and its own pybind types
        error = ort_error(e, f"to load {step}")
        if error is None:
            raise
        raise error from e
    for note in trainer.notes:
        err_console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)
    return trainer


@contextmanager
def _progress(steps: int, start_step: int, quiet: bool) -> Iterator[Callable[[int, StepResult], None]]:
    """A progress bar while the block runs; yields the per-step callback that updates it."""
    from mpgraph.cli.console import console

    columns = (
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )
    began = time.perf_counter()
    with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
        task = bar.add_task("train", total=steps, info="")
        skipped = 0

        def on_step(n: int, result: StepResult) -> None:
            nonlocal skipped
            skipped += bool(result.skipped)
            done = n - start_step
            if done % 10 == 0 or done == steps:
                rate = done / max(time.perf_counter() - began, 1e-9)
                scale = result.loss_scale
                info = f"loss {result.loss:.4g}" + (f"  scale {scale:g}" if scale is not None else "")
                bar.update(task, completed=done, info=f"{info}  skipped {skipped}  {rate:.0f} steps/s")

        yield on_step


def _write_reports(trainer: Trainer, step: Path, data: str, metrics: Path | None, plot: Path | None) -> None:
    from mpgraph.cli.plots import plot_losses

    if metrics is not None:
        if metrics.suffix.lower() == ".json":
            trainer.metrics.to_json(metrics)
        else:
            trainer.metrics.to_csv(metrics)
    if plot is not None:
        plot_losses({step.stem: trainer.metrics}, plot, title=f"{step.name} on {data}")


def _summary(trainer: Trainer, dataset: Dataset, data: str, run: int, elapsed: float, evaluate: bool) -> str:
    """The closing line: steps and speed, loss, scale, skips, CUDA graph, test accuracy."""
    from mpgraph.data import check_finite

    summary = trainer.metrics.summary()
    parts = [f"{run} steps in {elapsed:.1f}s ({run / max(elapsed, 1e-9):.0f} steps/s) on {trainer.provider}"]
    if summary["last_loss"] is not None and summary["first_loss"] is not None:
        parts.append(f"loss {summary['first_loss']:.4g} -> {summary['last_loss']:.4g}")
    if summary["nonfinite_losses"]:
        parts.append(f"{summary['nonfinite_losses']} non-finite losses")
    if summary["loss_scale"] is not None:
        parts.append(f"scale {summary['loss_scale']:g}")
    parts.append(f"skipped {summary['skipped']}")
    if trainer.provider == "cuda":
        parts.append("cuda graph" if trainer.cuda_graph else f"no cuda graph ({trainer.cuda_graph_reason})")
        parts.append("pipelined" if trainer.pipeline else f"not pipelined ({trainer.pipeline_reason})")
    if trainer.inplace:
        parts.append(f"state in place ({len(trainer.inplace)} of {len(trainer.pairs)} values)")
    if trainer.kernels_fused:
        # On CPU without a compiler only ORT's own ops (the NCHWc convolutions) run: say why.
        why = f"; no kernel library: {trainer.kernels_reason}" if trainer.kernels_reason else ""
        parts.append(f"fused kernels ({trainer.kernels_fused} rewrites{why})")
    elif trainer.provider == "cuda":
        parts.append(f"no fused kernels ({trainer.kernels_reason or 'nothing matched'})")
    plan = getattr(trainer.executor, "plan", None)
    if trainer.provider == "cuda" and plan is not None and plan.unfused_attention:
        parts.append(f"attention unfused ({plan.unfused_attention}: {plan.attention_reason})")
    if evaluate and dataset.test and dataset.task in ("classification", "sequence"):
        try:
            check_finite(dataset.test, f"dataset '{data}' (test split)")
            parts.append(f"test accuracy {trainer.evaluate(dataset.test)['accuracy']:.3f}")
        except MpgraphError as e:
            parts.append(f"no accuracy ({e})")
    return ", ".join(parts)


def train(
    step: Annotated[Path, typer.Argument(help="Training step graph (.onnx from `mpgraph train-graph`, optionally converted).")],
    data: Annotated[str, typer.Option("--data", "-d", help="digits, sequence, or a .npz whose keys are graph input names (test_<name> for the test split).")] = "digits",
    steps: Annotated[int, typer.Option("--steps", "-n", help="Steps to run (after --resume: steps more).")] = 1000,
    lr: Annotated[float | None, typer.Option("--lr", help="Learning rate; default: the graph's lr initializer.")] = None,
    batch: Annotated[int | None, typer.Option("--batch", "-b", help="Batch size (default 64; after --resume: the checkpoint's).")] = None,
    provider: Annotated[str, typer.Option("--provider", help="cpu or cuda.")] = "cpu",
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", parser=output_path, metavar="PATH", help="Write a checkpoint (.npz) here at the end (and every --checkpoint-every steps).")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Also checkpoint every N steps (0: only at the end).")] = 0,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue from this checkpoint (must come from the same graph).")] = None,
    metrics: Annotated[Path | None, typer.Option("--metrics", parser=output_path, metavar="PATH", help="Per-step metrics: .csv, or .json with a summary.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", parser=output_path, metavar="PATH", help="PNG of the loss curve.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Data shuffle (and generated data) seed (default 0; after --resume: the checkpoint's).")] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="ORT intra-op threads.")] = None,
    allow_cpu_fallback: Annotated[bool, typer.Option("--allow-cpu-fallback", help="cuda: run even if float nodes are placed on CPU.")] = False,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="Report test accuracy at the end (classification data).")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; print only the summary line.")] = False,
    tf32: Annotated[bool | None, typer.Option("--tf32/--no-tf32", help="cuda: let float32 matmuls run as TF32 (default: the graph's policy; fp32 is strict).")] = None,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph/--no-cuda-graph", help="cuda: capture the step as CUDA graphs and replay them (on by default; off with the reason when ORT cannot).")] = True,
    kernels: Annotated[bool | None, typer.Option("--kernels/--no-kernels", help="Run all of mpgraph's fused kernels (mpgraph.lowering; built with nvcc / a C++ compiler on first use); --no-kernels: none. Default: all on cuda where they build; on cpu the ones that pay there (ORT's NCHWc convolutions, AdamW, the Relu backward).")] = None,
    pipeline: Annotated[bool, typer.Option("--pipeline/--no-pipeline", help="cuda: launch step k+1 before reading step k's loss, so the host never waits for the GPU every step (on by default with CUDA graphs; the same results; --no-pipeline saves a third copy of the state).")] = True,
    inplace_state: Annotated[bool | None, typer.Option("--inplace-state/--two-state-sets", help="Write the updated state (parameters, optimizer moments) into its own buffers where provably safe: one copy of the state instead of two, but a non-finite step cannot be undone. Default: in place on CUDA when one state set is over 512 MiB, two sets otherwise.")] = None,
    deterministic: Annotated[bool, typer.Option("--deterministic", help="cuda: the same bits every run (ORT's deterministic compute, cuDNN's default convolution algorithm, the embedding gradient as a one-hot Gemm, bias-gradient sums as MatMuls; the bench GPT's bf16 step 1.07x slower). Needs strict fp32 matmuls.")] = False,
    provider_option: Annotated[list[str] | None, typer.Option("--provider-option", help="KEY=VALUE passed to the execution provider (repeatable), e.g. cudnn_conv_algo_search=HEURISTIC.")] = None,
    on_nonfinite: Annotated[str, typer.Option("--on-nonfinite", help="NaN/inf in a batch or the loss: stop (checkpoint the last good step, exit 2), skip (leave the state as it was and go on) or ignore.")] = "stop",
    nproc: Annotated[int, typer.Option("--nproc", help="Data-parallel on this many processes (torchrun, gloo on the CPU); --batch is the global batch. See docs/data-parallel.md.")] = 1,
    shard_optimizer: Annotated[bool, typer.Option("--shard-optimizer", help="With --nproc: each process keeps and updates its share of the optimizer state (ZeRO-1).")] = False,
) -> None:
    """Train STEP on a dataset: state stays on the device, loss scaling runs in the graph."""
    if nproc != 1 or shard_optimizer:  # mpgraph.cli.train_nproc: a torchrun launch; the one-process flags it lacks are refused
        from mpgraph.cli.train_nproc import train_with_nproc

        raise typer.Exit(train_with_nproc(nproc, step, data=data, steps=steps, lr=lr, batch=batch, seed=seed, threads=threads,
                                          checkpoint=checkpoint, checkpoint_every=checkpoint_every, resume=resume,
                                          shard_optimizer=shard_optimizer, on_nonfinite=on_nonfinite, provider=provider,
                                          unsupported={"--metrics": metrics is not None, "--plot": plot is not None}))
    from mpgraph.cli.console import console, err_console
    from mpgraph.errors import CheckpointError, TrainingError
    from mpgraph.runtime.trainer import FinalCheckpointError, run_training

    _check_args(step, steps, batch, checkpoint_every, threads, lr, on_nonfinite, checkpoint, metrics, plot)
    from mpgraph.runtime.options import RunOptions

    options = RunOptions(provider=provider, threads=threads, allow_cpu_fallback=allow_cpu_fallback, tf32=tf32,
                         provider_options=_provider_options(provider_option), cuda_graph=None if cuda_graph else False,
                         kernels=kernels, pipeline=None if pipeline else False, deterministic=deterministic,
                         inplace_state=inplace_state)
    trainer = _open_trainer(step, options)
    if resume is not None:
        trainer.load_checkpoint(resume)
    # A resumed run continues the checkpoint's data stream: its batch size and seed unless
    # given (other ones are refused), and the same data.
    batch, seed = _stream(trainer, batch, seed, resume)
    dataset = trainer.load_data(data, seed=seed)
    if resume is not None:
        trainer.check_resumed_data(dataset, batch)
    start_step = trainer.steps

    def warn(e: CheckpointError) -> None:
        err_console.print(f"[yellow]warning:[/] {escape(str(e))}", highlight=False, soft_wrap=True)

    unwritten: FinalCheckpointError | None = None
    with _progress(steps, start_step, quiet) as on_step:
        try:
            stop, elapsed = run_training(trainer, dataset, steps, lr, batch_size=batch, seed=seed, on_nonfinite=on_nonfinite,
                                checkpoint=checkpoint, checkpoint_every=checkpoint_every, callback=on_step,
                                on_checkpoint_error=warn, what=str(step))
        except FinalCheckpointError as e:  # the steps are done: report them, then the error
            unwritten, stop, elapsed = e, e.stop, e.seconds
        except (TrainingError, CheckpointError):
            _write_reports(trainer, step, data, metrics, plot)
            raise
    _write_reports(trainer, step, data, metrics, plot)
    if stop():
        where = ("the checkpoint could not be written (below)" if unwritten is not None
                 else f"checkpoint {checkpoint} written (resume with --resume {checkpoint})" if checkpoint is not None
                 else "no --checkpoint given, so the trained state is not saved")
        err_console.print(f"stopped by {stop.name} after step {trainer.steps}: {escape(where)}", highlight=False,
                          soft_wrap=True)
        if unwritten is not None:
            raise unwritten
        raise typer.Exit(130 if stop.name == "SIGINT" else 143)
    line = _summary(trainer, dataset, data, trainer.steps - start_step, elapsed, evaluate)
    written = [str(p) for p in (None if unwritten else checkpoint, metrics, plot) if p is not None]
    console.print(line + (f"; wrote {', '.join(written)}" if written else ""), highlight=False, soft_wrap=True)
    if unwritten is not None:
        raise unwritten

