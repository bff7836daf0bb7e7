"""Load and save models at the file boundary: clear errors, atomic writes, external data."""

from __future__ import annotations

import contextlib
import json
import logging
import math
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

from mpgraph._ir import meta as md
from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import (
    ModelLoadError,
    ModelSaveError,
    OutputError,
    UnsupportedModelError,
    first_line,
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
    "EXTERNAL_DATA_THRESHOLD",
]

#: Models whose tensors exceed this many bytes are saved with external data (protobuf's 2 GB cap).
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


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


def load_model(path: str | os.PathLike[str]) -> ir.Model:
    """Read an ONNX file (external data included) into onnx-ir, checked by ``load_proto``.

    Raises:
        ModelLoadError: Missing, unreadable, truncated or non-ONNX file; bad external data
            (naming the tensor and the path); malformed tensors or names.
    """
    proto = load_proto(path)
    try:
        return ir.from_proto(proto)
    except Exception as e:  # noqa: BLE001 - onnx-ir raises many types on malformed protos
        raise ModelLoadError(f"{Path(path)}: malformed ONNX model ({first_line(e)})") from e


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


def _json_meta(props: dict[str, str], key: str, path: str | os.PathLike[str]) -> object:
    try:
        return json.loads(props[key])
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: metadata '{key}' is not valid JSON ({first_line(e)})") from e


def check_metadata(proto: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """mpgraph's own model metadata (``mpgraph.*`` keys) is well formed and names real values.

    Rules:
        1. ``state_pairs`` and ``gradients`` are JSON lists of ``[name, name]`` string pairs;
           a state pair is (graph input, graph output), a gradient pair (graph input, value).
        2. ``loss`` and ``grad_seed`` name values of the graph.
        3. ``initializer_range`` is a JSON list of objects with ``name``, ``overflow``,
           ``underflow`` and ``action``; ``weight_bytes_before`` is an integer.
        4. ``training``, ``emulated`` and ``tf32`` are ``true`` or ``false``.
        5. ``loss_scale_state`` is a JSON object whose ``found_inf`` names a graph output and
           whose ``scale`` and ``growth_tracker`` (when present) name graph inputs.

    Raises:
        ModelLoadError: Naming the key and what is wrong with it.
    """
    props = {p.key: p.value for p in proto.metadata_props}
    if not any(k.startswith("mpgraph.") for k in props):
        return
    g = proto.graph
    inputs = {v.name for v in g.input}
    outputs = {v.name for v in g.output}
    values = inputs | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    for key, first_in, second_in, what in ((md.MODEL_STATE_PAIRS, inputs, outputs, "graph output"),
                                           (md.MODEL_GRADIENTS, inputs, values, "value")):
        if key not in props:
            continue
        pairs = _json_meta(props, key, path)
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
            raise ModelLoadError(f"{path}: metadata '{key}' should be a JSON list of [name, name] pairs")
        for a, b in pairs:
            if a not in first_in:
                raise ModelLoadError(f"{path}: metadata '{key}' names '{a}', which is not a graph input")
            if b not in second_in:
                raise ModelLoadError(f"{path}: metadata '{key}' names '{b}', which is not a {what} of the graph")
    for key in (md.MODEL_LOSS, md.MODEL_GRAD_SEED):
        if key in props and props[key] not in values:
            raise ModelLoadError(f"{path}: metadata '{key}' names '{props[key]}', which is not a value of the graph")
    if md.MODEL_INIT_RANGE in props:
        events = _json_meta(props, md.MODEL_INIT_RANGE, path)
        fields = ("name", "overflow", "underflow", "action")
        if not isinstance(events, list) or not all(isinstance(e, dict) and all(f in e for f in fields) for e in events):
            raise ModelLoadError(f"{path}: metadata '{md.MODEL_INIT_RANGE}' should be a JSON list of objects with "
                                 f"{', '.join(fields)}")
    if md.MODEL_LOSS_SCALING in props and not isinstance(_json_meta(props, md.MODEL_LOSS_SCALING, path), (dict, str)):
        raise ModelLoadError(f"{path}: metadata '{md.MODEL_LOSS_SCALING}' should be a JSON object")
    before = props.get(md.MODEL_WEIGHT_BYTES_BEFORE)
    if before is not None and not before.strip().isdigit():
        raise ModelLoadError(f"{path}: metadata '{md.MODEL_WEIGHT_BYTES_BEFORE}' should be an integer, got {before[:40]!r}")
    for key in (md.MODEL_TRAINING, md.MODEL_EMULATED, md.MODEL_TF32):
        if key in props and props[key] not in ("true", "false"):
            raise ModelLoadError(f"{path}: metadata '{key}' should be true or false, got {props[key][:40]!r}")
    if md.MODEL_LOSS_SCALE_STATE in props:
        _check_loss_scale_state(_json_meta(props, md.MODEL_LOSS_SCALE_STATE, path), inputs, outputs, path)


def _check_loss_scale_state(state: object, inputs: set[str], outputs: set[str], path: str | os.PathLike[str]) -> None:
    key = md.MODEL_LOSS_SCALE_STATE
    if not isinstance(state, dict) or "found_inf" not in state:
        raise ModelLoadError(f"{path}: metadata '{key}' should be a JSON object naming found_inf")
    for role, name in state.items():
        where = outputs if role == "found_inf" else inputs
        if role not in ("found_inf", "scale", "growth_tracker") or not isinstance(name, str) or name not in where:
            raise ModelLoadError(f"{path}: metadata '{key}' names {role} {name!r}, which is not a graph "
                                 f"{'output' if role == 'found_inf' else 'input'} (roles: found_inf, scale, growth_tracker)")


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def _tensors(proto: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """(where, tensor) for every initializer and tensor attribute of every graph."""
    for graph in _graphs(proto.graph):
        for t in graph.initializer:
            yield "initializer", t
        for sparse in graph.sparse_initializer:
            yield "sparse initializer", sparse.values
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield f"attribute '{attr.name}' of node", attr.t
                for t in attr.tensors:
                    yield f"attribute '{attr.name}' of node", t


def _name(text: object) -> str:
    """A proto string field as text (upb returns bytes for invalid UTF-8 in proto2 strings)."""
    return text if isinstance(text, str) else repr(text)


_KNOWN_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}
_ATTR_TYPES = frozenset(onnx.AttributeProto.AttributeType.values())


def _bad_string(message: google.protobuf.message.Message, where: str) -> str | None:
    """The path of the first string field holding bytes that are not UTF-8 (upb hands those
    over as ``bytes``), searching every field of every nested message; else ``None``."""
    string = google.protobuf.descriptor.FieldDescriptor.TYPE_STRING
    msg_type = google.protobuf.descriptor.FieldDescriptor.TYPE_MESSAGE
    stack = [(message, where)]
    while stack:
        msg, at = stack.pop()
        if isinstance(msg, onnx.TensorProto):  # ListFields would copy raw_data: check its strings only
            for name in ("name", "doc_string"):
                if not isinstance(getattr(msg, name), str):
                    return f"{at}.{name} = {getattr(msg, name)[:40]!r}"
            stack.extend((m, f"{at}.external_data[{i}]") for i, m in enumerate(msg.external_data))
            stack.extend((m, f"{at}.metadata_props[{i}]") for i, m in enumerate(getattr(msg, "metadata_props", ())))
            continue
        for field, value in msg.ListFields():
            if field.type == string:
                items = value if _is_repeated(field) else [value]
                for i, item in enumerate(items):
                    if not isinstance(item, str):
                        return f"{at}.{field.name}" + (f"[{i}]" if _is_repeated(field) else "") + f" = {item[:40]!r}"
            elif field.type == msg_type:
                if _is_repeated(field):
                    stack.extend((m, f"{at}.{field.name}[{i}]") for i, m in enumerate(value))
                else:
                    stack.append((value, f"{at}.{field.name}"))
    return None


def _is_repeated(field: google.protobuf.descriptor.FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return field.label == google.protobuf.descriptor.FieldDescriptor.LABEL_REPEATED


def check_opsets(proto: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """The default ONNX domain's opset is one the installed onnx knows (1 to its latest).

    A model declaring opset 99 was converted and turned into a step graph with exit 0: the
    passes read schemas of an opset that does not exist, and only ONNX Runtime, later, could
    not load the result.

    Raises:
        ModelLoadError: Naming the opset, the known range and the fix.
    """
    latest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and not 1 <= opset.version <= latest:
            raise ModelLoadError(f"{path}: imports opset {opset.version} of the default ONNX domain; onnx "
                                 f"{onnx.__version__} knows opsets 1 to {latest}: export the model at one of them")


def check_proto(proto: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """Every string is valid UTF-8 and element types are known ``TensorProto`` codes.

    Raises:
        ModelLoadError: Naming the value, node or tensor and the bad name or type code.
    """
    bad = _bad_string(proto, "model")
    if bad is not None:
        raise ModelLoadError(f"{path}: {bad} is not valid UTF-8")
    for graph in _graphs(proto.graph):
        for group, what in ((graph.input, "input"), (graph.output, "output"), (graph.value_info, "value")):
            for v in group:
                if not isinstance(v.name, str):
                    raise ModelLoadError(f"{path}: graph {what} name {v.name!r} is not valid UTF-8")
                _check_type(v.type, f"{what} '{v.name}'", path)
        for node in graph.node:
            for field in (node.name, node.op_type, node.domain, *node.input, *node.output):
                if not isinstance(field, str):
                    raise ModelLoadError(f"{path}: node {_name(node.name)!s} has a name {field!r} that is not valid UTF-8")
            for attr in node.attribute:
                if not isinstance(attr.name, str):
                    raise ModelLoadError(f"{path}: node '{node.name}' has an attribute name {attr.name!r} that is not valid UTF-8")
                if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and attr.name == "to":
                    if attr.type != onnx.AttributeProto.INT:
                        kind = onnx.AttributeProto.AttributeType.Name(attr.type) if attr.type in _ATTR_TYPES else attr.type
                        raise ModelLoadError(f"{path}: Cast '{node.name}' has a 'to' attribute of type {kind}; it must "
                                             "be an INT element type code (1 float, 10 float16, 16 bfloat16, ...)")
                    if attr.i not in _KNOWN_TYPES:
                        raise ModelLoadError(f"{path}: Cast '{node.name}' casts to unknown element type {attr.i}")
    for where, t in _tensors(proto):
        if not isinstance(t.name, str):
            raise ModelLoadError(f"{path}: {where} name {t.name!r} is not valid UTF-8")
        if t.data_type not in _KNOWN_TYPES:
            raise ModelLoadError(f"{path}: {where} '{t.name}' has unknown element type {t.data_type}")
    for prop in proto.metadata_props:
        if not isinstance(prop.key, str) or not isinstance(prop.value, str):
            raise ModelLoadError(f"{path}: metadata {prop.key!r} is not valid UTF-8")


def _check_type(tp: onnx.TypeProto, what: str, path: str | os.PathLike[str]) -> None:
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        inner = getattr(tp, kind)
        if inner.elem_type == onnx.TensorProto.UNDEFINED:
            raise ModelLoadError(f"{path}: {what} has no element type (0, UNDEFINED)")
        if inner.elem_type not in _KNOWN_TYPES:
            raise ModelLoadError(f"{path}: {what} has unknown element type {inner.elem_type}")
        for dim in inner.shape.dim:
            if not isinstance(dim.dim_param, str):
                raise ModelLoadError(f"{path}: {what} has a dimension name {dim.dim_param!r} that is not valid UTF-8")
    elif kind in ("sequence_type",):
        _check_type(tp.sequence_type.elem_type, what, path)
    elif kind == "optional_type":
        _check_type(tp.optional_type.elem_type, what, path)
    elif kind == "map_type":
        _check_type(tp.map_type.value_type, what, path)


def check_external_data(proto: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Every external-data reference stays inside the model's folder and can be read.

    Rules, checked before any byte is read:
        1. ``location`` is present, relative, and does not climb out of the folder (``../``).
        2. Neither the data file nor a folder on the way to it is a symlink.
        3. The file exists and holds ``offset + length`` bytes.

    Raises:
        ModelLoadError: Naming the tensor, its location and the rule it breaks.
    """
    model_path = Path(path)
    base = model_path.parent if str(model_path.parent) else Path(".")
    base_real = base.resolve()
    for where, t in _tensors(proto):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location")
        head = f"{model_path}: {where} '{_name(t.name)}'"
        if not location:
            raise ModelLoadError(f"{head} is stored externally but names no location")
        if not isinstance(location, str) or "\0" in location:
            raise ModelLoadError(f"{head}: external data location {location!r} is not a valid path")
        if os.path.isabs(location) or Path(location).is_absolute() or location.startswith(("/", "\\")):
            raise ModelLoadError(f"{head}: external data location '{location}' is an absolute path; "
                                 "it must be relative to the model's folder")
        parts = Path(os.path.normpath(location)).parts
        if not parts or parts[0] == ".." or ".." in Path(location).parts:
            raise ModelLoadError(f"{head}: external data location '{location}' points outside the model's folder")
        target = base / location
        walk = base
        for part in Path(location).parts:
            walk = walk / part
            if walk.is_symlink():
                raise ModelLoadError(f"{head}: external data location '{location}' is a symlink ({walk}); "
                                     "mpgraph reads only regular files inside the model's folder")
        try:
            inside = target.resolve().is_relative_to(base_real)
        except (OSError, RuntimeError):
            inside = False
        if not inside:
            raise ModelLoadError(f"{head}: external data location '{location}' points outside the model's folder")
        if not target.is_file():
            raise ModelLoadError(f"{head}: external data file '{location}' not found next to the model ({target})")
        try:
            offset = int(info.get("offset", "0") or 0)
            length = int(info["length"]) if info.get("length") not in (None, "") else None
        except ValueError:
            raise ModelLoadError(f"{head}: external data offset/length {info.get('offset')!r}/{info.get('length')!r} "
                                 "are not integers") from None
        size = target.stat().st_size
        if offset < 0 or (length is not None and length < 0):
            raise ModelLoadError(f"{head}: negative external data offset or length ({offset}, {length})")
        if offset + (length or 0) > size or offset > size:
            raise ModelLoadError(f"{head}: external data file '{location}' has {size} bytes, the tensor needs "
                                 f"offset {offset} + length {length or 0}")


def _item_bits(data_type: int) -> int | None:
    try:
        dtype = ir.DataType(data_type)
    except ValueError:
        return None
    if dtype in (ir.DataType.STRING, ir.DataType.UNDEFINED):
        return None
    return dtype.bitwidth


def check_tensor_sizes(proto: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """Every tensor's data (raw bytes or typed field) has as many elements as its shape says.

    Raises:
        ModelLoadError: Naming the tensor, its shape and element type, and the sizes.
    """
    typed_fields = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
    for where, t in _tensors(proto):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        if any(d < 0 for d in t.dims):
            raise ModelLoadError(f"{path}: {where} '{t.name}' has a negative dimension {list(t.dims)}")
        count = math.prod(t.dims)
        bits = _item_bits(t.data_type)
        kind = onnx.TensorProto.DataType.Name(t.data_type).lower()
        if t.HasField("raw_data"):
            if bits is None:
                continue
            want = (count * bits + 7) // 8
            if len(t.raw_data) != want:
                raise ModelLoadError(
                    f"{path}: {where} '{t.name}' holds {len(t.raw_data)} bytes, but shape {list(t.dims)} of "
                    f"{kind} needs {want}"
                )
            continue
        held = [(f, len(getattr(t, f))) for f in typed_fields if len(getattr(t, f))]
        if not held:
            continue
        field_name, n = held[0]
        per = 2 if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1
        if bits is not None and bits < 8:
            continue  # 4-bit types pack several values per int32_data entry
        want_n = count * per
        if n != want_n:
            raise ModelLoadError(
                f"{path}: {where} '{t.name}' holds {n} values in {field_name}, but shape {list(t.dims)} of "
                f"{kind} needs {want_n}"
            )


def check_node_order(model: ir.Model, path: str | os.PathLike[str] = "<model>") -> None:
    """Every node comes after the nodes that make its inputs, in every graph (ONNX's rule).

    The passes walk nodes in file order and copy graphs node by node: a model listed in
    another order ended in an internal error (onnx-ir's ``clone_graph``) or an invalid result.

    Raises:
        UnsupportedModelError: Naming the node, the value and the node that makes it later.
    """
    seen: dict[int, set[ir.Node]] = {}  # per graph: the nodes listed so far
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        before = seen.setdefault(id(node.graph), set())
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.graph is node.graph and producer not in before:
                raise UnsupportedModelError(
                    f"{path}: nodes are not in topological order: {node.op_type} '{node.name}' reads "
                    f"'{value.name}' before {producer.op_type} '{producer.name}' makes it; sort the graph "
                    "(onnx_ir.passes.common.TopologicalSortPass) or export it again")
        before.add(node)


def _tensor_bytes(model: ir.Model) -> int:
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
    use_external = _tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data
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
        value.const_value = ir.ExternalTensor("mpgraph-shape-only", 0, tensor.nbytes, tensor.dtype,
                                              shape=tensor.shape, name=value.name or "")
    try:
        yield
    finally:
        for value, tensor in swapped.items():
            value.const_value = tensor

