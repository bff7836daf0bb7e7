"""Load and save models at the file boundary: clear errors, atomic writes, external data."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import google.protobuf.message
import onnx
import onnx_ir as ir

from mpgraph.errors import ModelLoadError, ModelSaveError

__all__ = ["load_model", "save_model", "EXTERNAL_DATA_THRESHOLD"]

#: Models whose tensors exceed this many bytes are saved with external data (protobuf's 2 GB cap).
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load_model(path: str | os.PathLike[str]) -> ir.Model:
    """Read an ONNX file (external data included) into onnx-ir.

    Raises:
        ModelLoadError: Missing, unreadable, truncated or non-ONNX file.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file")
    if p.is_dir():
        raise ModelLoadError(f"{p}: is a directory, expected an .onnx file")
    try:
        proto = onnx.load(str(p), load_external_data=True)
    except (google.protobuf.message.DecodeError, RuntimeError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{p}: not a valid ONNX model (truncated or not ONNX: {_first_line(e)})") from None
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read ({e.strerror or e})") from None
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise ModelLoadError(f"{p}: not a valid ONNX model (no ir_version or graph)")
    try:
        return ir.from_proto(proto)
    except Exception as e:  # noqa: BLE001 - onnx-ir raises many types on malformed protos
        raise ModelLoadError(f"{p}: malformed ONNX model ({_first_line(e)})") from None


def _tensor_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save_model(model: ir.Model, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Write ``model`` atomically: a reader never sees a partial file, and a failure leaves none.

    Args:
        model: The model.
        path: Destination ``.onnx`` path.
        external_data: Force (True) or forbid (False) a ``<name>.data`` side file; by default
            used when the tensors exceed ``EXTERNAL_DATA_THRESHOLD``.

    Raises:
        ModelSaveError: The destination cannot be written.
    """
    dst = Path(path)
    parent = dst.parent if str(dst.parent) else Path(".")
    if not parent.is_dir():
        raise ModelSaveError(f"{dst}: cannot write (directory {parent} does not exist)")
    if dst.is_dir():
        raise ModelSaveError(f"{dst}: cannot write (is a directory)")
    use_external = _tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data
    try:
        tmpdir = tempfile.mkdtemp(prefix=f".{dst.name}.", dir=parent)
    except OSError as e:
        raise ModelSaveError(f"{dst}: cannot write ({e.strerror or e})") from None
    try:
        tmp = Path(tmpdir) / dst.name
        data_name = f"{dst.name}.data" if use_external else None
        ir.save(model, tmp, external_data=data_name)
        if data_name is not None:
            os.replace(Path(tmpdir) / data_name, parent / data_name)
        os.replace(tmp, dst)
    except OSError as e:
        raise ModelSaveError(f"{dst}: cannot write ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
