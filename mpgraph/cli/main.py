"""The ``mpgraph`` command line. Only this package prints; the library logs."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mpgraph.cli.checks import finite
from mpgraph.errors import MpgraphError, UsageError

__all__ = ["app", "main", "handle_errors", "finite"]

app = typer.Typer(
    name="mpgraph",
    help="Compile precision policies onto ONNX graphs; train and audit the result.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
policy_app = typer.Typer(help="Show and check precision policies.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


#: ``--debug`` (or ``MPGRAPH_DEBUG=1``): let unexpected exceptions show their traceback.
DEBUG = os.environ.get("MPGRAPH_DEBUG", "") not in ("", "0")


def _say_error(text: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(text)}", markup=True, highlight=False, soft_wrap=True)


def _os_error_line(e: OSError) -> str:
    where = e.filename if e.filename is not None else None
    what = e.strerror or str(e) or type(e).__name__
    return f"{where}: {what}" if where is not None else what


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def handle_errors(fn: F) -> F:
    """The error boundary of every command.

    1. ``MpgraphError`` (bad input a command foresaw): one ``error:`` line, exit code 2.
    2. ``OSError`` (disk full, permission denied, read-only file system) and ``MemoryError``:
       one line naming the file and the system's reason, exit code 2.
    3. Ctrl-C: ``interrupted``, exit code 130.
    4. Anything else is a bug in mpgraph: one line, the hint to rerun with ``--debug``, exit
       code 1; with ``--debug`` (or ``MPGRAPH_DEBUG=1``) the traceback instead.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.ClickException):
            raise
        except MpgraphError as e:
            if DEBUG:
                raise
            _say_error(str(e))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None
        except OSError as e:
            if DEBUG:
                raise
            _say_error(_os_error_line(e))
            raise typer.Exit(2) from None
        except MemoryError:
            if DEBUG:
                raise
            _say_error("out of memory")
            raise typer.Exit(2) from None
        except Exception as e:  # noqa: BLE001 - the boundary: an unforeseen failure is a bug
            if DEBUG:
                raise
            _say_error(f"internal error: {type(e).__name__}: {_first_line(e)} (run with --debug for the traceback)")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an unexpected error (a bug in mpgraph).")] = False,
) -> None:
    """Compile precision policies onto ONNX graphs; train and audit the result."""
    global DEBUG
    if debug:
        DEBUG = True


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command()
@handle_errors
def convert(
    model: Annotated[Path, typer.Argument(help="Input .onnx model (inference or training graph).")],
    policy: Annotated[str, typer.Option("--policy", "-p", help="Preset name (fp32, fp16, bf16, torch-autocast, tf-amp) or a YAML file.")] = "bf16",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output path; default IN.<policy>.onnx.")] = None,
    emulate: Annotated[bool, typer.Option("--emulate", help="CPU emulation: compute float32, round like the low dtype at every policy boundary.")] = False,
    calibrate: Annotated[str | None, typer.Option("--calibrate", help="Range check inputs: 'random' or an .npz of inputs. Default for float16: seeded random inputs; ops whose values exceed float16's range (or turn non-finite) stay float32.")] = None,
    no_calibrate: Annotated[bool, typer.Option("--no-calibrate", help="Skip the range check (float16 may then overflow to inf/NaN).")] = False,
    target: Annotated[str | None, typer.Option("--target", help="Where the model runs: cuda, cpu or any; ops without a low kernel there stay float32 (`mpgraph targets`). Default cuda, cpu with --emulate.")] = None,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Skip onnx.checker and strict shape inference.")] = False,
    no_opset_upgrade: Annotated[bool, typer.Option("--no-opset-upgrade", help="Keep the model's opset; ops whose schema has no low dtype there stay float32.")] = False,
    overwrite_input: Annotated[bool, typer.Option("--overwrite-input", help="Allow -o to name the input file.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only errors.")] = False,
) -> None:
    """Rewrite MODEL per a precision policy (casts inserted, decisions recorded)."""
    from mpgraph.audit import audit
    from mpgraph.cli.checks import check_output_path, read_inputs_npz
    from mpgraph.convert import convert_file
    from mpgraph.io import load_model
    from mpgraph.policy import load_policy

    pol = load_policy(policy)
    out = output or model.with_name(f"{model.stem}.{pol.name}{'.emulated' if emulate else ''}.onnx")
    check_output_path(out, "-o")
    feeds: Any = calibrate
    if calibrate is not None and calibrate != "random":
        feeds = read_inputs_npz(Path(calibrate), load_model(model), "--calibrate")
    start = time.perf_counter()
    with console.status(f"converting {model} with policy {pol.name}", spinner="dots") if not quiet else _null():
        result = convert_file(model, out, pol, emulate=emulate, validate=not no_validate, overwrite_input=overwrite_input,
                              calibrate=None if no_calibrate else (feeds if calibrate is not None else "auto"),
                              upgrade_opset=not no_opset_upgrade, target=target)
    elapsed = time.perf_counter() - start
    names = [n.name or "" for n in result.graph]
    for override in pol.overrides:
        if not any(override.matches(name) for name in names):
            err_console.print(f"[yellow]warning:[/] override {escape(repr(override.pattern))} matches no node of {escape(str(model))}",
                              highlight=False, soft_wrap=True)
    if quiet:
        return
    report = audit(result)
    low = sum(c for ops in report.ops.values() for p in ops.values() for d, c in p.items() if d == pol.dtype.name.lower())
    total = sum(c for ops in report.ops.values() for p in ops.values() for c in p.values())
    console.print(
        f"wrote [bold]{out}[/] in {elapsed:.2f}s: {low}/{total} ops in {pol.dtype.name.lower()}, "
        f"{report.casts_inserted} casts inserted, weights {_human_bytes(report.weight_bytes_before)} -> "
        f"{_human_bytes(report.weight_bytes_after)}"
        + (f", {report.rounds_inserted} emulation roundings" if emulate else "")
    )
    from mpgraph.cli.targets_cmd import conversion_notes

    for line in conversion_notes(result, emulate=emulate):
        console.print(line, highlight=False, soft_wrap=True)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@app.command("audit")
@handle_errors
def audit_cmd(
    model: Annotated[Path, typer.Argument(help="A model written by `mpgraph convert`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    nodes: Annotated[bool, typer.Option("--nodes", help="Also list every node with its precision and reason.")] = False,
    memory: Annotated[bool, typer.Option("--memory", help="Estimate a training step's memory: bytes per parameter by role, activations by liveness.")] = False,
    batch: Annotated[int, typer.Option("--batch", help="With --memory: the batch size symbolic dims take.")] = 1,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help="With --memory on a forward model: build its step graph with this optimizer (default adamw).")] = None,
    mem_policy: Annotated[str | None, typer.Option("--policy", help="With --memory on a float32 model: convert with this policy first.")] = None,
) -> None:
    """Show which ops run in which precision, the casts inserted, and weight bytes."""
    from mpgraph.audit import audit
    from mpgraph.io import load_model

    if memory:
        from mpgraph.cli.memory_cmd import memory_report

        return memory_report(model, batch=batch, optimizer=optimizer, policy=mem_policy, as_json=as_json)
    report = audit(load_model(model))
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
        return
    if report.policy is None:
        console.print(f"[yellow]{model} was not converted by mpgraph (no decisions recorded)[/]")
    console.print(
        f"[bold]{model}[/]  policy={report.policy}  dtype={report.dtype}"
        + ("  [cyan](CPU emulation)[/]" if report.emulated else "")
    )
    for role, ops in report.ops.items():
        precisions = sorted({p for counts in ops.values() for p in counts})
        table = Table(title=None if role == "all" else f"role: {role}", show_footer=True)
        table.add_column("op type", footer="total")
        for p in precisions:
            table.add_column(p, justify="right", footer=str(sum(c.get(p, 0) for c in ops.values())))
        for op_type, counts in ops.items():
            table.add_row(op_type, *(str(counts.get(p, "")) for p in precisions))
        console.print(table)
    console.print(
        f"casts inserted: {report.casts_inserted}   emulation roundings: {report.rounds_inserted}   "
        f"Cast nodes in graph: {report.casts_total}"
    )
    console.print(
        f"float weights: {_human_bytes(report.weight_bytes_before)} before -> {_human_bytes(report.weight_bytes_after)} after"
    )
    for event in report.initializer_range:
        console.print(
            f"[yellow]range:[/] {event['name']}: {event['overflow']} overflow, {event['underflow']} underflow -> {event['action']}"
        )
    reasons = Table(title="why (nodes per reason)")
    reasons.add_column("nodes", justify="right")
    reasons.add_column("reason")
    for reason, count in list(report.reasons.items())[:15]:
        reasons.add_row(str(count), reason)
    console.print(reasons)
    if nodes:
        detail = Table(title="nodes")
        for col in ("name", "op_type", "role", "precision", "reason"):
            detail.add_column(col)
        for rec in report.nodes:
            detail.add_row(*(rec[c] for c in ("name", "op_type", "role", "precision", "reason")))
        console.print(detail)


@app.command("compare")
@handle_errors
def compare_cmd(
    reference: Annotated[Path, typer.Argument(help="The float32 model.")],
    candidate: Annotated[Path, typer.Argument(help="The converted model (--emulate for bf16 on CPU).")],
    inputs: Annotated[Path | None, typer.Option("--inputs", help=".npz of inputs keyed by input name; default: seeded random.")] = None,
    threshold: Annotated[float, typer.Option("--threshold", help="Relative error at which a value counts as diverged.")] = 1e-2,
    top: Annotated[int, typer.Option("--top", help="How many of the worst values to list.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Training step graphs: also write a self-contained HTML page of the error along the graph.")] = None,
) -> None:
    """Run both models on the same inputs and show where the numbers diverge, value by value.

    On two training step graphs: one step each, comparing the loss, every gradient, the update
    and every value, and naming the first backward node that diverges."""
    from mpgraph.audit import compare
    from mpgraph.cli.checks import read_inputs_npz
    from mpgraph.io import load_model

    finite(threshold, "--threshold", low=0.0, low_open=True)
    if top < 0:
        raise UsageError(f"--top must be >= 0, got {top}")
    ref_model = load_model(reference)
    cand_model = load_model(candidate)
    feeds = read_inputs_npz(inputs, ref_model, "--inputs") if inputs is not None else None
    from mpgraph.cli.compare_train_cmd import compare_train_report, is_step_graph

    if is_step_graph(ref_model):
        return compare_train_report(ref_model, cand_model, feeds, threshold=threshold, top=top, as_json=as_json, html=html)
    if html is not None:
        raise UsageError("--html needs two training step graphs")
    report = compare(ref_model, cand_model, feeds, threshold=threshold)
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
        return
    table = Table(title="graph outputs")
    for col in ("output", "rel error", "max |diff|", "non-finite"):
        table.add_column(col)
    for v in report.outputs:
        table.add_row(v.name, f"{v.rel_error:.3g}", f"{v.max_abs_error:.3g}", str(v.nonfinite))
    console.print(table)
    if report.first_divergence is None:
        console.print(f"no value diverges beyond {threshold:g} ({len(report.values)} values compared)")
    else:
        v = report.first_divergence
        console.print(
            f"[bold]first divergence[/] (rel error > {threshold:g}, topological order): value '{escape(v.name)}' "
            f"from {escape(v.producer)} {escape(f'[{v.precision}]')}: {v.kind}, rel error {v.rel_error:.3g}, "
            f"non-finite {v.nonfinite}, flushed to zero {v.flushed}",
            highlight=False, soft_wrap=True,
        )
    worst = Table(title=f"worst {top} of {len(report.values)} values")
    for col in ("value", "producer", "precision", "kind", "rel error", "non-finite", "flushed"):
        worst.add_column(col)
    for v in report.worst(top):
        worst.add_row(v.name, v.producer, v.precision, v.kind, f"{v.rel_error:.3g}", str(v.nonfinite), str(v.flushed))
    console.print(worst)
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


@policy_app.command("show")
@handle_errors
def policy_show(name: Annotated[str, typer.Argument(help="Preset name or YAML path.")]) -> None:
    """Print a policy (preset or file), fully resolved."""
    from mpgraph.policy import load_policy

    pol = load_policy(name)
    console.print(f"[bold]{pol.name}[/]: dtype {pol.dtype.name.lower()}, unlisted ops: {pol.default_category}")
    if pol.description:
        console.print(pol.description)
    table = Table()
    for col in ("category", "op type", "reason"):
        table.add_column(col)
    for category in ("allow", "infer", "clear", "deny"):
        for op_type, (cat, reason) in sorted(pol.ops.items()):
            if cat == category:
                table.add_row(category, op_type, reason)
    if pol.ops:
        console.print(table)
    for override in pol.overrides:
        console.print(f"override {override.pattern!r} -> {override.precision}: {override.reason}")
    for pin in pol.pins:
        console.print(f"pin {pin.op_type} inputs {list(pin.inputs)}: {pin.reason}")
    console.print(f"keep_io_types: {pol.keep_io_types}   initializers: {pol.initializers}")
    console.print(f"loss_scaling: {pol.loss_scaling}")


@policy_app.command("list")
@handle_errors
def policy_list() -> None:
    """List the presets."""
    from mpgraph.policy import list_presets, load_policy

    for name in list_presets():
        pol = load_policy(name)
        console.print(f"{name:16s} {pol.dtype.name.lower():9s} loss scaling: {pol.loss_scaling.mode}")


@policy_app.command("check")
@handle_errors
def policy_check(path: Annotated[Path, typer.Argument(help="Policy YAML file.")]) -> None:
    """Validate a policy file; errors name file, line, key path, bad value and valid choices."""
    from mpgraph.policy import load_policy

    if not path.exists():
        raise MpgraphError(f"{path}: policy file not found")
    if path.is_dir():
        raise MpgraphError(f"{path}: is a directory, expected a policy .yaml file")
    text = str(path)
    pol = load_policy(text if path.is_absolute() or text.endswith((".yaml", ".yml")) or text.startswith(".") else f"./{path}")
    console.print(f"{path}: ok ({pol.dtype.name.lower()}, {len(pol.ops)} ops listed)")


def _register_plugins() -> None:
    for module in ("mpgraph.cli.train_graph_cmd", "mpgraph.cli.export_cmd", "mpgraph.cli.train_cmd",
                   "mpgraph.cli.check_grad_cmd", "mpgraph.cli.tune_cmd", "mpgraph.cli.advise_cmd",
                   "mpgraph.cli.targets_cmd", "mpgraph.cli.policy_cmd"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.register(app)


_register_plugins()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
