"""Load and save models at the file boundary: clear errors, atomic writes, external data."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import google.protobuf.descriptor
import google.protobuf.message
import onnx
import onnx.external_data_helper
import onnx_ir as ir

from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import (
    ModelLoadError,
    ModelSaveError,
    OutputError,
    first_line,
)
from mpgraph.io_checks import (
    check_external_data,
    check_metadata,
    check_node_order,
    check_opsets,
    check_proto,
    check_tensor_sizes,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ModelLike",
    "as_model",
    "as_proto",
    "load_proto",
    "load_model",
    "min_ir_version",
    "save_model",
    "write_atomic",
    "clean_stale_temporaries",
    "check_writable",
    "check_replaceable",
    "check_proto",
    "check_metadata",
    "check_external_data",
    "check_tensor_sizes",
    "check_node_order",
    "check_opsets",
    "shape_only_initializers",
    "check_model_any_size",
    "tensor_bytes",
    "EXTERNAL_DATA_THRESHOLD",
    "CHECK_WITHOUT_WEIGHTS_BYTES",
]

#: Models whose tensors exceed this many bytes are saved with external data (protobuf's 2 GB cap).
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
#: Models whose tensors exceed this many bytes are checked without their float weights
#: (``check_model_any_size``): the ONNX checker serialises the model first, and protobuf refuses 2 GiB.
CHECK_WITHOUT_WEIGHTS_BYTES = 1_500_000_000
#: The file a shape-only initializer's external-data reference names (``shape_only_initializers``).
SHAPE_ONLY_LOCATION = "mpgraph-shape-only"


#: What the API accepts as a model: onnx-ir, a protobuf, serialized bytes, or a path.
ModelLike = ir.Model | onnx.ModelProto | bytes | str | os.PathLike


def as_model(model: ModelLike, *, copy: bool = False) -> ir.Model:
    """The one way into onnx-ir: ``model`` as an ``ir.Model``.

    An ``ir.Model`` is returned as it is (a deep copy with ``copy``); a protobuf or bytes are
    deserialized (a new object, the argument is never changed); a path is read by
    ``load_model`` with all its checks.

    Raises:
        ModelLoadError: See ``load_model``.
    """
    if isinstance(model, ir.Model):
        return ir.from_proto(ir.to_proto(model)) if copy else model
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model)
    if isinstance(model, bytes):
        return ir.from_proto(onnx.load_from_string(model))
    return load_model(model)


def as_proto(model: ModelLike) -> onnx.ModelProto:
    """``model`` as a protobuf the caller may edit (a copy: the argument is never changed).

    For the proto-level tools (``onnx.version_converter``, shape inference); a path is read by
    ``load_proto`` with all its checks.

    Raises:
        ModelLoadError: See ``load_model``.
    """
    if isinstance(model, ir.Model):
        return ir.to_proto(model)
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return load_proto(model)


def load_model(path: str | os.PathLike[str], *, ordered: bool = False) -> ir.Model:
    """Read an ONNX file (external data included) into onnx-ir, checked by ``load_proto``.

    Args:
        path: The ``.onnx`` file.
        ordered: Also require the nodes in topological order (``check_node_order``): the
            entry check of the commands that rewrite the graph (``convert``, ``train-graph``).

    Raises:
        ModelLoadError: Missing, unreadable, truncated or non-ONNX file; bad external data
            (naming the tensor and the path); malformed tensors or names.
        UnsupportedModelError: ``ordered`` and a node reads a value a later node makes.
    """
    proto = load_proto(path)
    try:
        model = ir.from_proto(proto)
    except Exception as e:  # noqa: BLE001 - onnx-ir raises many types on malformed protos
        raise ModelLoadError(f"{Path(path)}: malformed ONNX model ({first_line(e)})") from e
    if ordered:
        check_node_order(model, Path(path))
    return model


def min_ir_version(opset_imports: Mapping[str, int]) -> int:
    """The lowest IR version that a model importing these opsets may declare (onnx's table).

    >>> min_ir_version({"": 18}), min_ir_version({"": 23})
    (8, 11)
    """
    ids = [onnx.helper.make_opsetid(domain, version) for domain, version in opset_imports.items()]
    return int(onnx.helper.find_min_ir_version_for(ids, True))


def load_proto(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Read an ONNX file (external data included) as a protobuf, checked.

    Before anything is loaded, every external-data reference is checked by mpgraph itself:
    its location must be a relative path inside the model's folder, not a symlink, an
    existing file, and long enough for the tensor's offset and length. After loading, the
    proto is checked for what onnx-ir and the passes would trip over later: names that are not
    valid UTF-8, unknown element types, and tensors whose byte count disagrees with their shape.

    Raises:
        ModelLoadError: Missing, unreadable, truncated or non-ONNX file; bad external data
            (naming the tensor and the path); malformed tensors or names.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file")
    if p.is_dir():
        raise ModelLoadError(f"{p}: is a directory, expected an .onnx file")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except (google.protobuf.message.DecodeError, RuntimeError, ValueError, UnicodeDecodeError, EOFError) as e:
        raise ModelLoadError(f"{p}: not a valid ONNX model (truncated or not ONNX: {first_line(e)})") from e
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read ({e.strerror or e})") from e
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise ModelLoadError(f"{p}: not a valid ONNX model (no ir_version or graph)")
    check_opsets(proto, p)
    check_proto(proto, p)
    check_metadata(proto, p)
    check_external_data(proto, p)
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, str(p.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        raise ModelLoadError(f"{p}: cannot read external data ({first_line(e)})") from e
    check_tensor_sizes(proto, p)
    return proto


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of ``model``'s initializers (from the IR: a proto's ``ByteSize`` serialises, and fails over 2 GiB)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save_model(model: ir.Model, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Write ``model`` atomically: a reader never sees a partial file, and a failure leaves none.

    The model is written into a hidden folder ``.NAME.<pid>.*`` next to ``path`` and moved
    into place. Such folders left by a killed run (its process is gone) are removed first.

    Args:
        model: The model.
        path: Destination ``.onnx`` path.
        external_data: Force (True) or forbid (False) a ``<name>.data`` side file; by default
            used when the tensors exceed ``EXTERNAL_DATA_THRESHOLD``.

    Raises:
        ModelSaveError: The destination cannot be written, or exists and is no regular file
            (a device node, a FIFO: ``check_replaceable``).
    """
    dst = Path(path)
    parent = dst.parent if str(dst.parent) else Path(".")
    if not parent.is_dir():
        raise ModelSaveError(f"{dst}: cannot write (directory {parent} does not exist)")
    if dst.is_dir():
        raise ModelSaveError(f"{dst}: cannot write (is a directory)")
    check_replaceable(dst, error=ModelSaveError)
    clean_stale_temporaries(dst)
    use_external = tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data
    try:
        tmpdir = tempfile.mkdtemp(prefix=f".{dst.name}.{os.getpid()}.", dir=parent)
    except OSError as e:
        raise ModelSaveError(f"{dst}: cannot write ({e.strerror or e})") from e
    try:
        tmp = Path(tmpdir) / dst.name
        data_name = f"{dst.name}.data" if use_external else None
        if data_name is not None:
            check_replaceable(parent / data_name, error=ModelSaveError)
        ir.save(model, tmp, external_data=data_name)
        if data_name is not None:
            os.replace(Path(tmpdir) / data_name, parent / data_name)
        os.replace(tmp, dst)
    except OSError as e:
        raise ModelSaveError(f"{dst}: cannot write ({e.strerror or e})") from e
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a hidden ``.NAME.<pid>.*.tmp`` file and a rename.

    A reader never sees a partial file; on failure (a full disk) the temporary file is
    removed and an existing ``path`` is left as it was.

    Raises:
        OutputError: The folder is missing, ``path`` exists and is no regular file
            (``check_replaceable``), or the write failed (the reason and that the old file,
            if any, is kept).
    """
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{target}: is a directory")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{target}: folder {folder} does not exist")
    check_replaceable(target)
    clean_stale_temporaries(target)
    kept = "; the previous file is kept" if target.exists() else ""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"{target}: cannot write ({e.strerror or e}){kept}") from e
    mask = os.umask(0)
    os.umask(mask)
    try:
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; give the file ordinary permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        _unlink_quietly(tmp)
        raise OutputError(f"{target}: cannot write ({e.strerror or e}){kept}") from e
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_writable(path: str | os.PathLike[str], flag: str) -> None:
    """Fail now, before any work, if ``path`` cannot be written (probed with a real file).

    Raises:
        OutputError: Naming ``flag``, the path and why (missing folder, a directory, a device
            or FIFO, read-only, permission denied, disk full).
    """
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{flag} {target}: cannot write (is a directory)")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{flag} {target}: cannot write (folder {folder} does not exist)")
    check_replaceable(target, flag)
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"{flag} {target}: cannot write ({e.strerror or e} in {folder})") from e
    os.close(fd)
    _unlink_quietly(probe)


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def check_replaceable(path: str | os.PathLike[str], flag: str = "", *,
                      error: type[ModelSaveError] = OutputError) -> None:
    """``path`` is new or a regular file: the only things an output may replace.

    The writers move a finished temporary file over the target, which would turn a device
    node or a FIFO into a regular file: ``-o /dev/null`` run as root would replace the
    system's ``/dev/null``. A symlink counts as what it points to.

    Raises:
        OutputError: (or ``error``) Naming ``flag``, the path and what it is.
    """
    target = Path(path)
    try:
        mode = target.stat().st_mode
    except OSError:
        return  # a new path (or a dangling link, which the rename replaces)
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return  # a folder is refused by the callers, with their own words
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    head = f"{flag} {target}" if flag else str(target)
    raise error(f"{head}: is {kind}, not a regular file; mpgraph writes only to regular files or new paths "
                "(name a file)")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the hidden temporaries of ``path`` that a killed run left behind.

    ``write_atomic`` and ``save_model`` name them ``.NAME.<pid>.<random>[.tmp]``; one whose
    process no longer exists is stale. (A process that is alive may be writing it now.)

    Returns:
        The removed paths.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    prefix = f".{target.name}."
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix):].split(".", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            continue
    if removed:
        logger.info("removed %d stale temporary file(s) of %s: %s", len(removed), target,
                    ", ".join(p.name for p in removed))
    return removed


@contextlib.contextmanager
def shape_only_initializers(model: ir.Model, keep_bytes: int = 4096) -> Iterator[None]:
    """Within the block, float initializers over ``keep_bytes`` serialise without their bytes.

    ``ir.to_proto(model)`` then keeps their names, dtypes and shapes (as an external-data
    reference to nowhere) but copies no weight bytes: shape inference needs no float weight
    values, and a full copy of a 2.5 GB model would add 2.5 GB to the peak memory.
    """
    swapped = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or value.dtype not in FLOAT_TYPES or tensor.nbytes <= keep_bytes:
            continue
        swapped[value] = tensor
        value.const_value = ir.ExternalTensor(SHAPE_ONLY_LOCATION, 0, tensor.nbytes, tensor.dtype,
                                              shape=tensor.shape, name=value.name or "")
    try:
        yield
    finally:
        for value, tensor in swapped.items():
            value.const_value = tensor



def check_model_any_size(model: ir.Model, proto: onnx.ModelProto | None = None, large: int | None = None) -> None:
    """``onnx.checker.check_model(full_check=True)`` of ``model`` at any size.

    Under ``large`` bytes of tensors (``CHECK_WITHOUT_WEIGHTS_BYTES`` by default) it checks ``proto`` (the caller's serialisation of
    ``model``, made here if ``None``). Over it, protobuf cannot serialise the model for the
    checker (a 540M-parameter float32 export is 2.15 GB), so the checker reads a copy without
    the float weights instead (``shape_only_initializers``), saved to a temporary folder beside
    an empty file its references name. Names, types, shapes, every node and the strict shape
    inference are still checked, just not the weight bytes, which the checker only counts.

    Raises:
        onnx.checker.ValidationError, onnx.shape_inference.InferenceError: What the checker finds.
    """
    if tensor_bytes(model) < (CHECK_WITHOUT_WEIGHTS_BYTES if large is None else large):
        onnx.checker.check_model(proto if proto is not None else ir.to_proto(model), full_check=True)
        return
    with shape_only_initializers(model):
        light = ir.to_proto(model)
    with tempfile.TemporaryDirectory(prefix="mpgraph-check-") as tmp:
        (Path(tmp) / SHAPE_ONLY_LOCATION).touch()
        path = Path(tmp) / "model.onnx"
        onnx.save(light, str(path))
        onnx.checker.check_model(str(path), full_check=True)
