"""``mpgraph export``: a PyTorch module to ONNX with parameters as explicit inputs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Annotated

import typer

from mpgraph.errors import MpgraphError

__all__ = ["register", "parse_input_spec", "load_module_class"]

_DTYPES = ("float32", "int64")


def parse_input_spec(spec: str) -> tuple[list[int], str]:
    """``64x4`` -> ([64, 4], float32); ``8x16:int64`` -> ([8, 16], int64)."""
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


def load_module_class(target: str) -> type:
    """``path/to/model.py:Net`` -> the class ``Net`` defined in that file."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name:
        raise MpgraphError(f"{target}: expected FILE.py:ClassName")
    path = Path(path_text)
    if not path.is_file():
        raise MpgraphError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"mpgraph_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise MpgraphError(f"{path}: cannot import as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        raise MpgraphError(f"{path}: importing it called sys.exit({e.code!r}); the file must define the class "
                           "without running a program (guard it with if __name__ == '__main__')") from None
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        raise MpgraphError(f"{path}: importing it failed: {type(e).__name__}: {_first_line(e)}") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise MpgraphError(f"{path}: defines no class '{name}'")
    return cls


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _user_code(what: str, target: str, call: object) -> object:
    """Run user code (a constructor, an export that runs ``forward``): any failure, including
    ``sys.exit``, becomes one line."""
    try:
        return call()  # type: ignore[operator]
    except MpgraphError:
        raise
    except SystemExit as e:
        raise MpgraphError(f"{target}: {what} called sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        raise MpgraphError(f"{target}: {what} failed: {type(e).__name__}: {_first_line(e)}") from e


def register(app: typer.Typer) -> None:
    from mpgraph.cli.main import console, handle_errors

    @app.command("export")
    @handle_errors
    def export(
        target: Annotated[str, typer.Argument(help="FILE.py:ClassName of a torch.nn.Module constructible without arguments. FILE.py is imported, i.e. its code runs, as with `python FILE.py`: export only code you trust.")],
        inputs: Annotated[list[str], typer.Option("--input", "-i", help="Example input shape, batch first: 64x4 or 8x16:int64; repeat for several inputs.")],
        output: Annotated[Path, typer.Option("--output", "-o", help="Output .onnx path.")],
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
        try:
            import torch
        except ImportError:
            raise MpgraphError("mpgraph export needs PyTorch: pip install 'mpgraph[torch]'") from None
        from mpgraph.cli.checks import check_output_path
        from mpgraph.export import export_module

        check_output_path(output, "-o")
        if not 18 <= opset <= 22:
            raise MpgraphError(f"--opset {opset}: valid 18 to 22")
        cls = load_module_class(target)
        if not issubclass(cls, torch.nn.Module):
            raise MpgraphError(f"{target}: '{cls.__name__}' is not a torch.nn.Module subclass")
        torch.manual_seed(seed)
        module = _user_code("constructing the module", target, cls)
        if not isinstance(module, torch.nn.Module):
            raise MpgraphError(f"{target}: constructing it gave a {type(module).__name__}, not a torch.nn.Module")
        module.train(train_mode)
        examples = []
        for spec in inputs:
            shape, dtype = parse_input_spec(spec)
            examples.append(torch.zeros(shape, dtype=torch.int64) if dtype == "int64" else torch.randn(shape))
        model = _user_code("exporting (running forward)", target,
                           lambda: export_module(module, examples, output, loss=loss, opset=opset))  # type: ignore[arg-type]
        params = sum(1 for i in model.graph.input if i.name in {t.name for t in model.graph.initializer})
        console.print(f"wrote {output}: {len(model.graph.node)} nodes, {params} parameters as inputs, outputs {[o.name for o in model.graph.output]}")
