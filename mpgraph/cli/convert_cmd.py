"""``mpgraph convert``: rewrite a model per a precision policy and say what changed."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from mpgraph.cli.console import console, err_console, human_bytes
from mpgraph.cli.paths import output_path

if TYPE_CHECKING:
    import onnx_ir as ir

    from mpgraph.policy import Policy

__all__ = ["convert"]


def convert(
    model: Annotated[Path, typer.Argument(help="Input .onnx model (inference or training graph).")],
    policy: Annotated[str, typer.Option("--policy", "-p", help="Preset name (fp32, fp16, bf16, torch-autocast, tf-amp) or a YAML file.")] = "bf16",
    output: Annotated[Path | None, typer.Option("--output", "-o", parser=output_path, metavar="PATH", help="Output path; default IN.<policy>.onnx.")] = None,
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
    with console.status(f"converting {model} with policy {pol.name}", spinner="dots") if not quiet else contextlib.nullcontext():
        result = convert_file(model, out, pol, emulate=emulate, validate=not no_validate, overwrite_input=overwrite_input,
                              calibrate=None if no_calibrate else (feeds if calibrate is not None else "auto"),
                              upgrade_opset=not no_opset_upgrade, target=target)
    elapsed = time.perf_counter() - start
    names = [n.name or "" for n in result.graph]
    for override in pol.overrides:
        if not any(override.matches(name) for name in names):
            err_console.print(f"[yellow]warning:[/] override {escape(repr(override.pattern))} matches no node of {escape(str(model))}",
                              highlight=False, soft_wrap=True)
    if not quiet:
        _summary(result, out, pol, elapsed, emulate=emulate)


def _summary(result: ir.Model, out: Path, pol: Policy, elapsed: float, *, emulate: bool) -> None:
    """The lines after a conversion: ops lowered, casts, weight bytes, then the targets' notes."""
    from mpgraph.audit import audit
    from mpgraph.cli.targets_cmd import conversion_notes
    from mpgraph.dtypes import is_float

    report = audit(result)
    low = sum(c for ops in report.ops.values() for p in ops.values() for d, c in p.items() if d == pol.dtype.name.lower())
    total = sum(c for ops in report.ops.values() for p in ops.values() for c in p.values())
    # An initializer that is also a graph input is a default a caller may replace (a step
    # graph's master weights, an export's parameters): no constant, so it stays float32 in
    # the file and is cast where a low op reads it. Without saying so, "427 KiB -> 427 KiB"
    # after a bf16 conversion reads as if nothing was lowered.
    as_inputs = sum(v.const_value.nbytes for v in result.graph.inputs
                    if v.const_value is not None and v.is_initializer() and is_float(v.dtype))
    console.print(
        f"wrote [bold]{out}[/] in {elapsed:.2f}s: {low}/{total} ops in {pol.dtype.name.lower()}, "
        f"{report.casts_inserted} casts inserted, weights {human_bytes(report.weight_bytes_before)} -> "
        f"{human_bytes(report.weight_bytes_after)}"
        + (f" ({human_bytes(as_inputs)} of them initialize graph inputs: kept float32, cast at run time)"
           if as_inputs and not pol.is_identity else "")
        + (f", {report.rounds_inserted} emulation roundings" if emulate else "")
    )
    if report.fp8 is not None:
        tensors = report.fp8["tensors"].values()
        formats = sorted({t["format"] for t in tensors})
        console.print(f"fp8: {len(tensors)} tensors quantised ("
                      + ", ".join(f"{sum(t['format'] == f for t in tensors)} {f}" for f in formats)
                      + f"), {report.fp8['recipe']['used']} scaling; `mpgraph audit` lists them", highlight=False)
    for line in conversion_notes(result, emulate=emulate):
        console.print(line, highlight=False, soft_wrap=True)
