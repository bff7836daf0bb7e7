"""How much memory does a training step take? Bytes by role, and activations by liveness.

``estimate_memory`` reads a training step graph (float32 or converted) and answers the two
questions a user asks before renting a GPU:

1. **Bytes per parameter, by role**, for the model's policy: the low-precision weight copies
   (a ``Cast(to=low)`` of a parameter), the float32 master weights (the parameter inputs),
   the gradients the optimizer reads, and the optimizer state (Adam's ``m`` and ``v``). bf16
   weights, fp32 master weights and Adam's two moments are 2 + 4 + 4 + 4 = 14 bytes per
   parameter, before gradients and activations.
2. **Activation memory.** Shapes are inferred with every symbolic dimension set to the batch
   size (or ``dims``); each buffer lives from the node that makes it to the last node that
   reads it, walking the graph's node order (a topological order, the one ORT receives).
   View ops (``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Flatten``, ``Identity``) alias their
   input, as ORT's kernels do. "Kept for the backward" is every forward buffer that a
   backward node reads; the transient peak is the largest sum of live buffers.

The estimated peak is the persistent bytes (every graph input and initializer: parameters,
state, data, constants), plus the output buffers (a trainer binds the updated state to a
second set of buffers), plus the transient peak. Kernel workspaces (cuBLAS, cuDNN) and the
allocator's rounding are not modelled; ``benchmarks/memory_check.py`` measures the gap on
ORT CUDA.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.errors import MpgraphError, first_line

__all__ = ["MemoryReport", "estimate_memory", "ROLES", "VIEW_OPS"]

#: Roles of the per-parameter table, in print order.
ROLES = ("low_weights", "master_weights", "gradients", "optimizer_state")
#: Ops whose output shares its input's buffer in ORT (no new allocation).
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Memory of one training step at a given batch size.

    Attributes:
        policy: Policy recorded on the model (``None``: float32, never converted).
        dtype: Low dtype recorded on the model.
        batch: The batch size symbolic dimensions were set to.
        parameters: Number of trained parameter elements.
        role_bytes: Bytes per role (``ROLES``).
        bytes_per_parameter: ``role_bytes`` divided by ``parameters``.
        other_state_bytes: Other state inputs (running statistics, loss scale, the optimizer's
            step counter).
        data_bytes: Graph inputs that are not state (the batch).
        constant_bytes: Initializers that are not graph inputs.
        output_bytes: Graph outputs (the updated state's second buffers, the loss).
        saved_for_backward_bytes: Forward buffers read by a backward node.
        saved_for_backward_values: How many such buffers.
        transient_peak_bytes: Largest sum of live intermediate buffers.
        transient_peak_node: Node at which that peak happens.
        estimated_peak_bytes: Persistent + outputs + transient peak.
        unknown_shapes: Intermediate values whose shape could not be inferred (not counted).
        nodes: Nodes walked.
    """

    policy: str | None
    dtype: str | None
    batch: int
    parameters: int
    role_bytes: dict[str, int]
    bytes_per_parameter: dict[str, float]
    other_state_bytes: int
    data_bytes: int
    constant_bytes: int
    output_bytes: int
    saved_for_backward_bytes: int
    saved_for_backward_values: int
    transient_peak_bytes: int
    transient_peak_node: str
    estimated_peak_bytes: int
    unknown_shapes: int
    nodes: int

    @property
    def persistent_bytes(self) -> int:
        """Parameters, state, data and constants: allocated for the whole step."""
        return sum(self.role_bytes[r] for r in ("master_weights", "optimizer_state")) + (
            self.other_state_bytes + self.data_bytes + self.constant_bytes
        )

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["persistent_bytes"] = self.persistent_bytes
        return json.dumps(data, indent=2, sort_keys=True)


def _itemsize(elem_type: int) -> int | None:
    """Bytes per element as numpy holds it (ORT too); None for an unknown or undefined type."""
    try:
        return int(np.dtype(ir.DataType(elem_type).numpy()).itemsize)
    except (TypeError, ValueError):
        return None


def _concrete(proto: onnx.ModelProto, batch: int, dims: Mapping[str, int]) -> dict[str, int | None]:
    """Set symbolic input dims, infer shapes, and return bytes per value name (None: unknown)."""
    graph = proto.graph
    for value in (*graph.input, *graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") or not dim.HasField("dim_value"):
                dim.dim_value = int(dims.get(dim.dim_param, batch))
    del graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as e:  # noqa: BLE001 - onnx raises InferenceError and bare RuntimeErrors
        raise MpgraphError(f"shape inference failed at batch {batch}: {first_line(e)}") from None
    sizes: dict[str, int | None] = {}
    g = inferred.graph
    for info in (*g.value_info, *g.output, *g.input):
        t = info.type.tensor_type
        item = _itemsize(t.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if item is None or not t.HasField("shape") or any(d is None for d in shape):
            sizes.setdefault(info.name, None)
        else:
            sizes[info.name] = int(np.prod(shape, dtype=np.int64)) * item
    for init in g.initializer:
        item = _itemsize(init.data_type)
        sizes[init.name] = int(np.prod(init.dims, dtype=np.int64)) * (item or 0)
    return sizes


def _per_parameter(model: ir.Model, state: str) -> bool:
    """Optimizer state held per parameter element (moments), not a scalar such as the step."""
    if not state.startswith("optim/"):
        return False
    value = next((v for v in model.graph.inputs if v.name == state), None)
    return value is None or value.shape is None or value.shape.rank() > 0


def _buffers(model: ir.Model) -> dict[str, str]:
    """Value name -> name of the buffer it lives in (view ops alias their input)."""
    owner: dict[str, str] = {}
    for node in model.graph:
        for value in node.outputs:
            if not value.name:
                continue
            src = node.inputs[0] if node.op_type in VIEW_OPS and node.inputs and node.inputs[0] is not None else None
            owner[value.name] = owner.get(src.name or "", src.name or "") if src is not None else value.name
    return owner


def estimate_memory(model: ir.Model, *, batch: int = 1, dims: Mapping[str, int] | None = None) -> MemoryReport:
    """Estimate a training step's memory by role and by liveness.

    Args:
        model: A training step graph (``build_training_graph``), float32 or converted.
        batch: Value of every symbolic input dimension not named in ``dims``.
        dims: Symbolic dimension name -> value (e.g. ``{"seq": 512}``).

    Raises:
        MpgraphError: Not a training step graph, or shapes cannot be inferred.
    """
    props = model.metadata_props
    if md.MODEL_GRADIENTS not in props or md.MODEL_STATE_PAIRS not in props:
        raise MpgraphError("not a training step graph (no mpgraph.gradients metadata): run train-graph first, "
                           "or pass --optimizer to build one")
    if batch < 1:
        raise MpgraphError(f"batch must be >= 1, got {batch}")
    sizes = _concrete(ir.to_proto(model), batch, dims or {})
    gradients = [(p, g) for p, g in json.loads(props[md.MODEL_GRADIENTS])]
    params = {p for p, _ in gradients}
    state_inputs = {a for a, _ in json.loads(props[md.MODEL_STATE_PAIRS])}

    def size(name: str) -> int:
        return sizes.get(name) or 0

    n_params = 0
    for value in model.graph.inputs:
        if value.name in params and value.shape is not None and value.shape.is_static():
            n_params += int(np.prod(value.shape.numpy(), dtype=np.int64)) if value.shape.rank() else 1
    low_copies = 0
    for node in model.graph:
        if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None and node.inputs[0].name in params:
            if node.metadata_props.get(md.NODE_INSERTED) != "round":
                low_copies += size(node.outputs[0].name or "")
    roles = {
        "low_weights": low_copies,
        "master_weights": sum(size(p) for p in params),
        "gradients": sum(size(g) for _, g in gradients),
        "optimizer_state": sum(size(s) for s in state_inputs if s not in params and _per_parameter(model, s)),
    }
    other_state = sum(size(s) for s in state_inputs if s not in params and not _per_parameter(model, s))
    input_names = {v.name for v in model.graph.inputs}
    data = sum(size(v.name or "") for v in model.graph.inputs if v.name not in state_inputs)
    constants = sum(size(n) for n in model.graph.initializers if n not in input_names)
    outputs = {v.name for v in model.graph.outputs}
    output_bytes = sum(size(n or "") for n in outputs)

    peak, peak_node, saved, saved_n, unknown = _liveness(model, sizes, outputs)
    persistent = roles["master_weights"] + roles["optimizer_state"] + other_state + data + constants
    return MemoryReport(
        policy=props.get(md.MODEL_POLICY),
        dtype=props.get(md.MODEL_DTYPE),
        batch=batch,
        parameters=n_params,
        role_bytes=roles,
        bytes_per_parameter={r: (b / n_params if n_params else 0.0) for r, b in roles.items()},
        other_state_bytes=other_state,
        data_bytes=data,
        constant_bytes=constants,
        output_bytes=output_bytes,
        saved_for_backward_bytes=saved,
        saved_for_backward_values=saved_n,
        transient_peak_bytes=peak,
        transient_peak_node=peak_node,
        estimated_peak_bytes=persistent + output_bytes + peak,
        unknown_shapes=unknown,
        nodes=len(model.graph),
    )


def _liveness(
    model: ir.Model, sizes: Mapping[str, int | None], outputs: set[str | None]
) -> tuple[int, str, int, int, int]:
    """Walk the node order: (transient peak, its node, saved-for-backward bytes and count, unknown)."""
    owner = _buffers(model)
    nodes = list(model.graph)
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    role_of: dict[str, str] = {}
    backward_reads: set[str] = set()
    roles: dict[str, str] = {}  # value name -> role of its producer
    for i, node in enumerate(nodes):
        role = node.metadata_props.get(md.NODE_ROLE)
        if role is None:
            # Inserted casts carry no role: they take their input's; a copy of a graph input
            # (a low weight, counted as such) is no activation.
            src = node.inputs[0] if node.inputs else None
            role = roles.get(src.name or "", "forward") if src is not None and src.producer() is not None else "weight"
        for value in node.outputs:
            roles[value.name or ""] = role
        for value in node.inputs:
            buf = owner.get(value.name or "") if value is not None else None
            if buf is not None:
                end[buf] = max(end.get(buf, i), i)
                if role == "backward":
                    backward_reads.add(buf)
        for value in node.outputs:
            buf = owner.get(value.name or "")
            if buf is None:
                continue
            if buf == value.name:
                start[buf] = i
                role_of[buf] = role
            end[buf] = max(end.get(buf, i), i)
            if value.name in outputs:
                end[buf] = len(nodes)
    unknown = 0
    alloc: dict[int, int] = {}
    free: dict[int, int] = {}
    for buf, i in start.items():
        if buf in outputs:
            continue  # outputs are bound to their own buffers, counted separately
        nbytes = sizes.get(buf)
        if nbytes is None:
            unknown += 1
            continue
        alloc[i] = alloc.get(i, 0) + nbytes
        free[end[buf]] = free.get(end[buf], 0) + nbytes
    live = peak = 0
    peak_node = ""
    for i, node in enumerate(nodes):
        live += alloc.get(i, 0)
        if live > peak:
            peak, peak_node = live, f"{node.op_type} '{node.name}'"
        live -= free.get(i, 0)
    kept = [b for b in backward_reads if role_of.get(b) in ("forward", "loss") and sizes.get(b) is not None]
    return peak, peak_node, sum(sizes[b] or 0 for b in kept), len(kept), unknown
