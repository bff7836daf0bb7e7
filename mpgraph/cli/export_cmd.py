"""``mpgraph export``: a PyTorch module to ONNX with parameters as explicit inputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import typer

from mpgraph.cli.console import console
from mpgraph.cli.paths import output_path
from mpgraph.errors import MpgraphError

__all__ = ["export_command", "parse_input_spec"]

_DTYPES = ("float32", "int64")


def parse_input_spec(spec: str) -> tuple[list[int], str]:
    """``64x4`` -> ([64, 4], float32); ``8x16:int64`` -> ([8, 16], int64).

    >>> parse_input_spec("8x16:int64")
    ([8, 16], 'int64')
    """
    shape_text, _, dtype = spec.partition(":")
    dtype = dtype or "float32"
    if dtype not in _DTYPES:
        raise MpgraphError(f"--input {spec}: invalid dtype '{dtype}'; valid: {', '.join(_DTYPES)}")
    try:
        shape = [int(d) for d in shape_text.lower().split("x")]
    except ValueError:
        raise MpgraphError(f"--input {spec}: expected a shape like 64x4 (optionally :int64)") from None
    if not shape or any(d < 1 for d in shape):
        raise MpgraphError(f"--input {spec}: every dimension must be >= 1")
    return shape, dtype


def export_command(
    target: Annotated[str, typer.Argument(help="FILE.py:ClassName of a torch.nn.Module constructible without arguments. FILE.py is imported, i.e. its code runs, as with `python FILE.py`: export only code you trust.")],
    inputs: Annotated[list[str], typer.Option("--input", "-i", help="Example input shape, batch first: 64x4 or 8x16:int64; repeat for several inputs.")],
    output: Annotated[Path, typer.Option("--output", "-o", parser=output_path, metavar="PATH", help="Output .onnx path.")],
    loss: Annotated[str | None, typer.Option("--loss", help="Attach a loss: cross_entropy or mse.")] = None,
    train_mode: Annotated[bool, typer.Option("--train/--eval", help="Export train-mode behaviour (BatchNorm batch statistics) or eval mode.")] = True,
    opset: Annotated[int, typer.Option("--opset", help="Default-domain opset (18-22).")] = 18,
    seed: Annotated[int, typer.Option("--seed", help="torch.manual_seed before constructing the module.")] = 0,
) -> None:
    """Export a PyTorch module: parameters become explicit, initialised graph inputs.

    Warning: FILE.py is imported, so its code runs with your permissions. Export only code you trust.
    """
    if loss not in (None, "cross_entropy", "mse"):
        raise MpgraphError(f"--loss: invalid value '{loss}'; valid: cross_entropy, mse")
    if importlib.util.find_spec("torch") is None:
        raise MpgraphError("mpgraph export needs PyTorch: pip install 'mpgraph[torch]'")
    from mpgraph.cli.checks import check_output_path
    from mpgraph.export import export_file

    check_output_path(output, "-o")
    if not 18 <= opset <= 22:
        raise MpgraphError(f"--opset {opset}: valid 18 to 22")
    shapes = [parse_input_spec(spec) for spec in inputs]
    model = export_file(target, shapes, output, loss=loss, train=train_mode, opset=opset, seed=seed)  # type: ignore[arg-type]
    params = sum(1 for i in model.graph.input if i.name in {t.name for t in model.graph.initializer})
    console.print(f"wrote {output}: {len(model.graph.node)} nodes, {params} parameters as inputs, outputs {[o.name for o in model.graph.output]}")
