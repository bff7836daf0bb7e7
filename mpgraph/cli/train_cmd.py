"""``mpgraph train``: run a training step graph on a dataset with a progress bar.

Everything that can fail before the first step (numbers, output paths, model, provider,
dtype on that provider, dataset and its labels, resume checkpoint) is checked first, so a run
that cannot start writes nothing and leaves an existing checkpoint as it was.

A run never loses its work:

1. SIGINT (Ctrl-C) and SIGTERM (schedulers, ``docker stop``) finish the step in flight, then
   write the checkpoint, metrics and plot, and exit 130 / 143; ``--resume`` continues bit for
   bit. A second signal stops at once without writing (the last checkpoint is kept).
2. A checkpoint that cannot be written (a full disk) keeps the last good one and says which
   step it holds; at ``--checkpoint-every`` the run goes on, at the end it is an error.
3. Non-finite data or a non-finite loss stops the run at that step (``--on-nonfinite stop``,
   the state checkpointed is that of the last good step) or skips the step (``skip``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated

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

from mpgraph.errors import MpgraphError

__all__ = ["register", "train"]


def _vocab(trainer: object, token_input: str) -> int | None:
    """Rows of the embedding table a token input indexes (a Gather on it), if any."""
    for node in trainer.model.graph:  # type: ignore[attr-defined]
        if node.op_type == "Gather" and len(node.inputs) > 1 and node.inputs[1] is not None \
                and node.inputs[1].name == token_input and node.inputs[0] is not None \
                and node.inputs[0].shape is not None and isinstance(node.inputs[0].shape[0], int):
            return int(node.inputs[0].shape[0])
    return None


_ORT_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)' Status Message: (.*)")


def _ort_error(e: Exception, what: str) -> MpgraphError | None:
    """One line for an ONNX Runtime failure (naming the node when ORT does), else ``None``."""
    text = str(e).strip()
    from_ort = type(e).__module__.startswith("onnxruntime") or (
        isinstance(e, RuntimeError) and any(k in text for k in ("ONNXRuntimeError", "status code", "Error in execution")))
    if not from_ort:
        return None
    match = _ORT_NODE.search(text)
    if match is not None:
        return MpgraphError(f"onnxruntime failed {what} at node '{match[2]}' ({match[1]}): {match[3].splitlines()[0]}")
    first = text.splitlines()[0] if text else type(e).__name__
    return MpgraphError(f"onnxruntime failed {what}: {first.replace('[ONNXRuntimeError] : ', '')}")


def _check_folder(path: Path | None, what: str) -> None:
    """The output path can be written (a real probe file), so no step runs in vain."""
    from mpgraph.cli.checks import check_output_path
    from mpgraph.io import clean_stale_temporaries

    if path is None:
        return
    check_output_path(path, f"--{what}")
    clean_stale_temporaries(path)


def train(
    step: Annotated[Path, typer.Argument(help="Training step graph (.onnx from `mpgraph train-graph`, optionally converted).")],
    data: Annotated[str, typer.Option("--data", "-d", help="digits, sequence, or a .npz whose keys are graph input names (test_<name> for the test split).")] = "digits",
    steps: Annotated[int, typer.Option("--steps", "-n", help="Steps to run (after --resume: steps more).")] = 1000,
    lr: Annotated[float | None, typer.Option("--lr", help="Learning rate; default: the graph's lr initializer.")] = None,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Batch size.")] = 64,
    provider: Annotated[str, typer.Option("--provider", help="cpu or cuda.")] = "cpu",
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="Write a checkpoint (.npz) here at the end (and every --checkpoint-every steps).")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Also checkpoint every N steps (0: only at the end).")] = 0,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue from this checkpoint (must come from the same graph).")] = None,
    metrics: Annotated[Path | None, typer.Option("--metrics", help="Per-step metrics: .csv, or .json with a summary.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="PNG of the loss curve.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Data shuffle (and generated data) seed.")] = 0,
    threads: Annotated[int | None, typer.Option("--threads", help="ORT intra-op threads.")] = None,
    allow_cpu_fallback: Annotated[bool, typer.Option("--allow-cpu-fallback", help="cuda: run even if float nodes are placed on CPU.")] = False,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="Report test accuracy at the end (classification data).")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; print only the summary line.")] = False,
    tf32: Annotated[bool | None, typer.Option("--tf32/--no-tf32", help="cuda: let float32 matmuls run as TF32 (default: the graph's policy; fp32 is strict).")] = None,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph/--no-cuda-graph", help="cuda: capture the step as CUDA graphs and replay them (on by default; off with the reason when ORT cannot).")] = True,
    provider_option: Annotated[list[str] | None, typer.Option("--provider-option", help="KEY=VALUE passed to the execution provider (repeatable), e.g. cudnn_conv_algo_search=HEURISTIC.")] = None,
    on_nonfinite: Annotated[str, typer.Option("--on-nonfinite", help="NaN/inf in a batch or the loss: stop (checkpoint the last good step, exit 2), skip (leave the state as it was and go on) or ignore.")] = "stop",
) -> None:
    """Train STEP on a dataset: state stays on the device, loss scaling runs in the graph."""
    from mpgraph.cli.checks import finite, positive_int
    from mpgraph.cli.main import console, err_console
    from mpgraph.data import check_finite, check_labels, dataset_for_model, token_input
    from mpgraph.errors import CheckpointError, TrainingError, UsageError
    from mpgraph.runtime.trainer import (
        NONFINITE_MODES,
        Trainer,
        metrics_path,
        plot_losses,
        stop_on_signals,
    )

    positive_int(steps, "--steps", minimum=0)
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
    for path, what in ((checkpoint, "checkpoint"), (metrics, "metrics"), (plot, "plot")):
        _check_folder(path, what)
    if checkpoint is not None:
        _check_folder(metrics_path(checkpoint), "checkpoint")

    try:
        options = {}
        for item in provider_option or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise MpgraphError(f"--provider-option {item!r}: expected KEY=VALUE")
            options[key] = value
        trainer = Trainer(step, provider, threads=threads, allow_cpu_fallback=allow_cpu_fallback,
                          provider_options=options, tf32=tf32, cuda_graph=None if cuda_graph else False)
        for note in trainer.notes:
            err_console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)
    except MpgraphError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT raises RuntimeError and its own pybind types
        error = _ort_error(e, f"to load {step}")
        if error is None:
            raise
        raise error from e
    tok = token_input(trainer.data_inputs)
    vocab = _vocab(trainer, tok.name) if tok is not None else None
    dataset = dataset_for_model(data, trainer.data_inputs, seed=seed, vocab=vocab)
    bounds = trainer.label_bounds()
    check_labels(dataset.train, bounds, f"dataset '{data}'")
    check_labels(dataset.test, bounds, f"dataset '{data}' (test split)")
    if resume is not None:
        trainer.load_checkpoint(resume)
    start_step = trainer.steps

    def save() -> None:
        if checkpoint is not None:
            trainer.save_checkpoint(checkpoint)

    def write_reports() -> None:
        if metrics is not None:
            if metrics.suffix.lower() == ".json":
                trainer.metrics.to_json(metrics)
            else:
                trainer.metrics.to_csv(metrics)
        if plot is not None:
            plot_losses({step.stem: trainer.metrics}, plot, title=f"{step.name} on {data}")

    columns = (
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )
    began = time.perf_counter()
    with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
        task = bar.add_task("train", total=steps, info="")
        skipped = 0

        def on_step(n: int, result: object) -> None:
            nonlocal skipped
            skipped += bool(result.skipped)  # type: ignore[attr-defined]
            done = n - start_step
            if done % 10 == 0 or done == steps:
                rate = done / max(time.perf_counter() - began, 1e-9)
                scale = result.loss_scale  # type: ignore[attr-defined]
                info = f"loss {result.loss:.4g}" + (f"  scale {scale:g}" if scale is not None else "")  # type: ignore[attr-defined]
                bar.update(task, completed=done, info=f"{info}  skipped {skipped}  {rate:.0f} steps/s")
            if checkpoint_every and n % checkpoint_every == 0:
                try:
                    save()
                except CheckpointError as e:  # a full disk: keep training, keep the last good one
                    err_console.print(f"[yellow]warning:[/] {escape(str(e))}; training goes on", highlight=False,
                                      soft_wrap=True)

        try:
            with stop_on_signals() as stop:
                trainer.fit(dataset, steps, lr, batch_size=batch, seed=seed, callback=on_step,
                            on_nonfinite=on_nonfinite, stop=stop)
        except KeyboardInterrupt:
            last = trainer.last_checkpoint_step
            raise MpgraphError(
                "interrupted again: stopped at once without writing a checkpoint"
                + (f"; the last checkpoint ({checkpoint}, step {last}) is kept" if last is not None else "")
            ) from None
        except TrainingError as e:
            written = ""
            if checkpoint is not None:
                save()
                written = f"; wrote checkpoint {checkpoint} (step {trainer.steps})"
            write_reports()
            raise TrainingError(f"{e}{written}") from e
        except MpgraphError:
            raise
        except Exception as e:  # noqa: BLE001
            error = _ort_error(e, f"running step {trainer.steps + 1} of {step}")
            if error is None:
                raise
            raise error from e
    elapsed = time.perf_counter() - began
    save()
    write_reports()
    if stop():
        code = 130 if stop.name == "SIGINT" else 143
        where = (f"checkpoint {checkpoint} written (resume with --resume {checkpoint})" if checkpoint is not None
                 else "no --checkpoint given, so the trained state is not saved")
        err_console.print(f"stopped by {stop.name} after step {trainer.steps}: {escape(where)}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(code)
    summary = trainer.metrics.summary()
    run = trainer.steps - start_step
    parts = [f"{run} steps in {elapsed:.1f}s ({run / max(elapsed, 1e-9):.0f} steps/s) on {provider}"]
    if summary["last_loss"] is not None and summary["first_loss"] is not None:
        parts.append(f"loss {summary['first_loss']:.4g} -> {summary['last_loss']:.4g}")
    if summary["nonfinite_losses"]:
        parts.append(f"{summary['nonfinite_losses']} non-finite losses")
    if summary["loss_scale"] is not None:
        parts.append(f"scale {summary['loss_scale']:g}")
    parts.append(f"skipped {summary['skipped']}")
    if provider == "cuda":
        parts.append("cuda graph" if trainer.cuda_graph else f"no cuda graph ({trainer.cuda_graph_reason})")
    if evaluate and dataset.test and dataset.task in ("classification", "sequence"):
        try:
            check_finite(dataset.test, f"dataset '{data}' (test split)")
            acc = trainer.evaluate(dataset.test)
            parts.append(f"test accuracy {acc['accuracy']:.3f}")
        except MpgraphError as e:
            parts.append(f"no accuracy ({e})")
    written = [str(p) for p in (checkpoint, metrics, plot) if p is not None]
    console.print(", ".join(parts) + (f"; wrote {', '.join(written)}" if written else ""), highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``train`` to the ``mpgraph`` app."""
    from mpgraph.cli.main import handle_errors

    app.command("train")(handle_errors(train))
