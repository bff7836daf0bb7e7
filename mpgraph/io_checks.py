"""Checks on a model at the load boundary: what onnx-ir and the passes would trip over later.

``load_proto`` runs them on every file it reads (opsets, names and element types, metadata,
external-data references, tensor byte counts); ``check_node_order`` checks an ``ir.Model``
once it is in memory. Each raises ``ModelLoadError`` or ``UnsupportedModelError`` naming the
file, the tensor or node, and the fix. ``mpgraph.io`` re-exports them all.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import google.protobuf.descriptor
import google.protobuf.message
import onnx
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import check_recorded
from mpgraph.errors import ModelLoadError, UnsupportedModelError, first_line

__all__ = [
    "check_external_data",
    "check_metadata",
    "check_node_order",
    "check_opsets",
    "check_proto",
    "check_tensor_sizes",
]


def _json_meta(props: dict[str, str], key: str, path: str | os.PathLike[str]) -> object:
    try:
        return json.loads(props[key])
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: metadata '{key}' is not valid JSON ({first_line(e)})") from e


def check_metadata(proto: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """mpgraph's own model metadata (``mpgraph.*`` keys) is well formed and names real values.

    Rules:
        1. The step contract's keys (``state_pairs``, ``gradients``, ``loss``, ``grad_seed``,
           ``training``, ``loss_scale_state``) pass ``_ir.contract.check_recorded``: pairs of
           real inputs and outputs or values, names of real values, ``true``/``false``, the
           loss-scale state's roles naming graph outputs and inputs.
        2. ``initializer_range`` is a JSON list of objects with ``name``, ``overflow``,
           ``underflow`` and ``action``; ``weight_bytes_before`` is an integer.
        3. ``emulated`` and ``tf32`` are ``true`` or ``false``.

    Raises:
        ModelLoadError: Naming the key and what is wrong with it.
    """
    props = {p.key: p.value for p in proto.metadata_props}
    if not any(k.startswith("mpgraph.") for k in props):
        return
    g = proto.graph
    inputs = {v.name for v in g.input}
    values = inputs | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    try:
        check_recorded(props, inputs=inputs, outputs={v.name for v in g.output}, values=values)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
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
    for key in (md.MODEL_EMULATED, md.MODEL_TF32):
        if key in props and props[key] not in ("true", "false"):
            raise ModelLoadError(f"{path}: metadata '{key}' should be true or false, got {props[key][:40]!r}")


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
