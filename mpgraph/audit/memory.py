"""How much memory does a training step take? Bytes by role, and activations by liveness.

``estimate_memory`` reads a training step graph (float32 or converted) and answers the two
questions a user asks before renting a GPU:

1. **Bytes per parameter, by role**, for the model's policy: the low-precision weight copies
   (a ``Cast(to=low)`` of a parameter), the float32 master weights (the parameter inputs),
   the gradients the optimizer reads, and the optimizer state (Adam's ``m`` and ``v``). bf16
   weights, fp32 master weights and Adam's two moments are 2 + 4 + 4 + 4 = 14 bytes per
   parameter, before gradients and activations.
2. **Activation memory.** Shapes are inferred with every symbolic dimension set to the batch
   size (or ``dims``). The nodes are walked in ORT's execution order (``ort_order``); each
   buffer lives from the node that makes it to the last node that reads it. View ops
   (``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Flatten``, ``Identity``) alias their input, as
   ORT's kernels do. "Kept for the backward" is every forward buffer that a backward node
   reads; the transient peak is the largest sum of live buffers.
3. **ORT's memory pattern.** With ``enable_mem_pattern`` (ORT's default, and the Trainer's),
   ORT records the first step's allocations and from the second step on allocates one block
   that holds every intermediate at a planned offset. The arena keeps the first step's
   buffers as well, so the intermediates are held twice: the transient peak, and the block
   (``_pattern_block`` packs the same buffers as ORT's planner does; gaps make it larger).

The estimated peak is the persistent bytes (every graph input and initializer: parameters,
state, data, constants), plus the output buffers (a trainer binds the updated state to a
second set of buffers), plus the transient peak, plus the pattern block. It is the graph's
own memory, with ORT's arena growing by what is requested (``kSameAsRequested``; the default
power-of-two growth can hold up to twice the requests). Not modelled: the fixed overhead of a
CUDA session (cuBLAS/cuDNN handles and workspaces, kernel code; measured for a tiny model by
``benchmarks/memory_check.py``), kernel scratch buffers, the nodes that ORT's graph
optimizations fuse or remove, and the buffers ORT's planner reuses in place.
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

__all__ = ["MemoryReport", "estimate_memory", "ort_order", "ROLES", "VIEW_OPS", "PATTERN_ALIGNMENT"]

#: Roles of the per-parameter table, in print order.
ROLES = ("low_weights", "master_weights", "gradients", "optimizer_state")
#: ORT's allocation alignment (``kAllocAlignment``): the memory pattern rounds every buffer up to it.
PATTERN_ALIGNMENT = 64
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
        pattern_block_bytes: ORT's memory-pattern block: the same buffers packed at fixed offsets
            as ORT's ``MemPatternPlanner`` does (``_pattern_block``).
        estimated_peak_bytes: Persistent + outputs + transient peak + pattern block (ORT's
            default, ``enable_mem_pattern``; ``peak_without_pattern_bytes`` without it).
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
    pattern_block_bytes: int
    estimated_peak_bytes: int
    unknown_shapes: int
    nodes: int

    @property
    def peak_without_pattern_bytes(self) -> int:
        """The peak with ORT's memory pattern off (``SessionOptions.enable_mem_pattern = False``)."""
        return self.estimated_peak_bytes - self.pattern_block_bytes

    @property
    def persistent_bytes(self) -> int:
        """Parameters, state, data and constants: allocated for the whole step."""
        return sum(self.role_bytes[r] for r in ("master_weights", "optimizer_state")) + (
            self.other_state_bytes + self.data_bytes + self.constant_bytes
        )

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["persistent_bytes"] = self.persistent_bytes
        data["peak_without_pattern_bytes"] = self.peak_without_pattern_bytes
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


def _folded_transpose(node: ir.Node) -> bool:
    """A ``Transpose`` that ORT folds into the matmuls reading it (``MatmulTransposeFusion``,
    ``GemmTransposeFusion``): every consumer is a ``MatMul`` (the last two axes swapped) or a
    ``Gemm`` (a 2-D transpose), and it is no graph output. ORT removes it, and its consumers
    read its input with a transpose flag: no buffer. The exported ``Linear`` is such a
    ``Transpose`` of the weight, a copy of every weight kept for the backward otherwise."""
    perm_attr = node.attributes.get("perm")
    if node.op_type != "Transpose" or perm_attr is None or node.outputs[0].is_graph_output():
        return False
    perm = list(perm_attr.as_ints())
    swaps_last_two = len(perm) >= 2 and perm == [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2]
    uses = [use.node.op_type for use in node.outputs[0].uses()]
    return bool(uses) and swaps_last_two and all(op == "MatMul" or (op == "Gemm" and len(perm) == 2) for op in uses)


def _buffers(nodes: list[ir.Node]) -> dict[str, str]:
    """Value name -> name of the buffer it lives in (view ops and folded transposes alias their input)."""
    owner: dict[str, str] = {}
    for node in nodes:
        for value in node.outputs:
            if not value.name:
                continue
            alias = node.op_type in VIEW_OPS or _folded_transpose(node)
            src = node.inputs[0] if alias and node.inputs and node.inputs[0] is not None else None
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

    nodes = ort_order(model)
    buffers, saved, saved_n, unknown = _walk(nodes, sizes, outputs)
    (peak, peak_node), block = _peak(buffers, nodes), _pattern_block(buffers)
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
        pattern_block_bytes=block,
        estimated_peak_bytes=persistent + output_bytes + peak + block,
        unknown_shapes=unknown,
        nodes=len(model.graph),
    )


def ort_order(model: ir.Model) -> list[ir.Node]:
    """The nodes in the order ORT's default execution plan runs them.

    ORT numbers nodes as the file lists them and sorts topologically by a reverse depth-first
    walk: from the nodes no node consumes (the last one first), a node is emitted after its
    producers, visiting the producer with the highest number first (``GraphViewer`` with
    ``ExecutionOrder::DEFAULT``). ORT's graph optimizations then fuse some nodes, which this
    order does not follow.
    """
    nodes = list(model.graph)
    index = {id(n): i for i, n in enumerate(nodes)}
    consumed = {id(v.producer()) for n in nodes for v in n.inputs if v is not None and v.producer() is not None}
    stack: list[tuple[ir.Node, bool]] = [(n, False) for n in nodes if id(n) not in consumed]
    visited: set[int] = set()
    order: list[ir.Node] = []
    while stack:
        node, leave = stack.pop()
        if leave:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        producers = {id(p): p for v in node.inputs if v is not None and (p := v.producer()) is not None}
        stack.extend((p, False) for p in sorted(producers.values(), key=lambda p: index[id(p)])
                     if id(p) not in visited)
    return order


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """An intermediate buffer: made by node ``start``, last read by node ``end`` (walk positions)."""

    name: str
    start: int
    end: int
    nbytes: int


def _walk(
    nodes: list[ir.Node], sizes: Mapping[str, int | None], outputs: set[str | None]
) -> tuple[list[_Buffer], int, int, int]:
    """Buffers of the intermediates (not outputs) in ``nodes``' order, and the saved-for-backward
    bytes, their count and the intermediates of unknown size."""
    owner = _buffers(nodes)
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
    known = [b for b in start if b not in outputs and sizes.get(b) is not None]
    unknown = sum(1 for b in start if b not in outputs and sizes.get(b) is None)
    buffers = [_Buffer(b, start[b], end[b], sizes[b] or 0) for b in known]
    kept = [b for b in backward_reads if role_of.get(b) in ("forward", "loss") and sizes.get(b) is not None]
    return buffers, sum(sizes[b] or 0 for b in kept), len(kept), unknown


def _peak(buffers: list[_Buffer], nodes: list[ir.Node]) -> tuple[int, str]:
    """Largest sum of live buffers, and the node where it happens. A node's outputs are allocated
    while its inputs are still alive; a buffer is freed after the last node that reads it."""
    alloc: dict[int, int] = {}
    free: dict[int, int] = {}
    for b in buffers:
        alloc[b.start] = alloc.get(b.start, 0) + b.nbytes
        free[b.end] = free.get(b.end, 0) + b.nbytes
    live = peak = 0
    peak_node = ""
    for i, node in enumerate(nodes):
        live += alloc.get(i, 0)
        if live > peak:
            peak, peak_node = live, f"{node.op_type} '{node.name}'"
        live -= free.get(i, 0)
    return peak, peak_node


def _pattern_block(buffers: list[_Buffer], align: int = PATTERN_ALIGNMENT) -> int:
    """Size of ORT's memory-pattern block for these buffers.

    ORT's ``MemPatternPlanner`` replays the first step's allocations: each buffer takes the
    smallest gap between live blocks that fits it (rounded up to ``align`` bytes), or goes after
    the live block with the highest offset; the block is the highest end ever reached. Gaps
    left by freed buffers make it larger than the live peak.
    """
    events = sorted([(b.start, 0, k) for k, b in enumerate(buffers)] + [(b.end, 1, k) for k, b in enumerate(buffers)])
    blocks: list[tuple[int, int, int]] = []  # (offset, size, buffer) sorted by offset
    size = 0
    for _, kind, k in events:
        if kind == 1:
            blocks = [blk for blk in blocks if blk[2] != k]
            continue
        need = -(-buffers[k].nbytes // align) * align
        best, best_offset, waste, current = len(blocks), (blocks[-1][0] + blocks[-1][1]) if blocks else 0, None, 0
        for j, (offset, nbytes, _) in enumerate(blocks):
            gap = offset - current
            if gap >= need and (waste is None or gap - need < waste):
                best, best_offset, waste = j, current, gap - need
            current = offset + nbytes
        size = max(size, best_offset + need)
        blocks.insert(best, (best_offset, need, k))
    return size
