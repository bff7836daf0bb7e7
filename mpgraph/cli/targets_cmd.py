"""``mpgraph targets``: the probed provider x op x dtype table; notes after ``convert``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mpgraph.cli.console import console

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["targets_command", "conversion_notes"]

_MARK = {"ok": "[green]ok[/]", "fp32": "[yellow]fp32[/]", "no": "[red]no[/]", "n/a": "[dim]n/a[/]", None: "[dim]-[/]"}


def targets_command(
    op: Annotated[list[str] | None, typer.Option("--op", help="Only these op types (repeatable).")] = None,
    opset: Annotated[int, typer.Option("--opset", help="Model opset: cells come from the highest probed opset not above it.")] = 22,
    missing: Annotated[bool, typer.Option("--missing", help="Only ops some provider cannot run in a low dtype.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
) -> None:
    """Which ops ONNX Runtime's CPU and CUDA providers run in float16 / bfloat16 (probed).

    ok: a kernel in that dtype; fp32: it runs, but ORT computes it in float32 behind Casts it
    inserts (CPU float16); no: ORT refuses the node; -: not probed. `convert --target`
    keeps float32 the ops marked no.
    """
    import onnx

    from mpgraph.errors import UsageError
    from mpgraph.targets import kernel_cell, probed_opsets, tables

    if not 1 <= opset <= onnx.defs.onnx_opset_version():
        raise UsageError(f"--opset must be an ONNX opset, 1 to {onnx.defs.onnx_opset_version()} (onnx "
                         f"{onnx.__version__}), got {opset}")
    data = tables()
    providers = sorted(data)
    ops = sorted({o for p in providers for o in data[p]["ops"]})
    if op:
        unknown = sorted(set(op) - set(ops))
        if unknown:
            raise UsageError(f"--op: no probe covered {', '.join(unknown)}; probed ops: `mpgraph targets`")
        ops = sorted(set(op))
    columns = [(p, d) for p in providers for d in ("float16", "bfloat16")]
    rows = {o: {f"{p}/{d}": kernel_cell(p, o, d, opset) for p, d in columns} for o in ops}
    if missing:
        rows = {o: r for o, r in rows.items() if "no" in r.values()}
    if as_json:
        meta = {p: {"onnxruntime": data[p]["onnxruntime"], "probe": data[p]["probe"], "opsets": probed_opsets(p)} for p in providers}
        sys.stdout.write(json.dumps({"opset": opset, "providers": meta, "ops": rows}, indent=1) + "\n")
        return
    for p in providers:
        console.print(
            f"{p}: ONNX Runtime {data[p]['onnxruntime']}, probed at opsets {probed_opsets(p)} by {data[p]['probe']}",
            highlight=False,
        )
    table = Table(title=f"low-precision kernels at opset {opset}")
    table.add_column("op type", no_wrap=True)
    for p, d in columns:
        table.add_column(f"{p} {d}", justify="center")
    for o, row in rows.items():
        table.add_row(o, *(_MARK.get(row[f"{p}/{d}"], "?") for p, d in columns))
    console.print(table)
    console.print("ok kernel | fp32 runs in float32 behind Casts ORT inserts | no ORT refuses | - not probed")


def conversion_notes(model: ir.Model, *, emulate: bool) -> list[str]:
    """Lines ``convert`` prints after its summary: range check, target, CPU float16 caveat."""
    from mpgraph._ir import meta as md

    props = model.metadata_props
    lines: list[str] = []
    raw = props.get(md.MODEL_CALIBRATION)
    dtype = props.get(md.MODEL_DTYPE, "")
    if raw:
        cal = json.loads(raw)
        kept = cal.get("kept_float32", {})
        total = sum(kept.values())
        labels = {"range": f"beyond {dtype}'s range / 2", "non-finite": f"non-finite in {dtype}"}
        why = ", ".join(f"{n} {labels.get(k, k)}" for k, n in sorted(kept.items()))
        lines.append(
            f"range check on {escape(cal['feeds'])}: {total} ops kept float32" + (f" ({why})" if why else "")
            + "; outputs finite where float32's are"
        )
        if cal.get("values_flushing"):
            worst = ", ".join(f"'{escape(n)}' {share:.2%}" for n, share in cal.get("worst_flushing", [])[:3])
            lines.append(
                f"[yellow]underflow:[/] {cal['values_flushing']} values have nonzero entries that flush to zero in "
                f"{dtype} (most: {worst}); `mpgraph compare` shows what that does to the outputs"
            )
    elif dtype == "float16" and md.MODEL_TRAINING not in props:
        lines.append("[yellow]no range check[/] (--no-calibrate, or ORT CPU cannot run the float32 model): float16 may overflow")
    target = props.get(md.MODEL_TARGET)
    gaps = sum(n.metadata_props.get(md.NODE_PHASE) == md.Phase.KERNEL_GAP for n in model.graph)
    if target:
        lines.append(
            f"target {target}: {gaps} ops kept float32 for lack of a {dtype} kernel there"
            + ("" if emulate else " (`mpgraph targets`; --target cpu|cuda|any)")
        )
    lowered = sum(n.metadata_props.get(md.NODE_PRECISION) == dtype for n in model.graph)
    if not emulate and target == "cpu" and gaps and not lowered:
        lines.append(f"[yellow]note:[/] nothing lowered: ORT CPU has no {dtype} kernel for these ops; --emulate shows {dtype} numbers on CPU")
    if not emulate and dtype == "float16" and target in ("cpu", "any"):
        lines.append(
            "[yellow]note:[/] ORT CPU computes native float16 ops in float32 (it inserts Casts), so overflow and "
            "underflow do not show there; --emulate rounds like float16 hardware on CPU"
        )
    return lines
