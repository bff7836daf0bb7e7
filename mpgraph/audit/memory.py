"""How much memory does a training step take? Bytes by role, and activations by liveness.

``estimate_memory`` reads a training step graph (float32 or converted) and answers the two
questions a user asks before renting a GPU:

1. **Bytes per parameter, by role**, for the model's policy: the low-precision weight copies
   (a ``Cast(to=low)`` of a parameter), the float32 master weights (the parameter inputs),
   the gradients the optimizer reads, and the optimizer state (Adam's ``m`` and ``v``). bf16
   weights, fp32 master weights and Adam's two moments are 2 + 4 + 4 + 4 = 14 bytes per
   parameter, before gradients and activations.
2. **Activation memory.** Shapes are inferred with every symbolic dimension set to the batch
   size (or ``dims``); above ``PROBE_LIMIT`` they are inferred at small values and
   interpolated, so a batch of 10**12 costs what a batch of 2048 does. The nodes are walked in ORT's execution order (``ort_order``); each
   buffer lives from the node that makes it to the last node that reads it. View ops
   (``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Flatten``, ``Identity``) alias their input, as
   ORT's kernels do; so does a ``Transpose`` that ORT folds into the matmuls reading it, and a
   ``Transpose`` of a ``Transpose`` reads the first one's input, as ORT composes them.
   "Kept for the backward" is every forward buffer that a backward node reads; the transient
   peak is the largest sum of live buffers.
3. **ORT's arena and memory pattern.** In the first step ORT allocates each buffer from its
   BFC arena; freed chunks are reused, but the arena's regions never merge, so it grows past
   the transient peak (``_arena_bytes`` replays the buffers through the same best-fit
   allocator). With ``enable_mem_pattern`` (ORT's default, and the Trainer's except in the
   sessions that capture CUDA graphs), ORT records that first step and from the second step
   on allocates one block that holds every intermediate at a planned offset; the arena keeps
   the first step's regions as well, so the intermediates are held twice (``_pattern_block``
   packs the buffers as ORT's planner does). The arena's growth is its
   ``arena_extend_strategy``: ``kSameAsRequested`` (what the Trainer's CUDA sessions use) or
   ORT's default ``kNextPowerOfTwo``, whose last regions are mostly empty (``ort_alloc``).
4. **In-place state.** With ``inplace=True`` each state output that may overwrite its input
   (``mpgraph._ir.inplace``: an elementwise update, every other reader of the old value an
   ancestor of it; state values of one element are left in two sets) shares its input's buffer,
   as a Trainer with ``inplace_state`` binds it: no second buffer for it.

The estimated peak is the persistent bytes (every graph input and initializer: parameters,
state, data, constants), plus the output buffers (a trainer binds the updated state to a
second set of buffers, less the state updated in place), plus a third state set for a pipelined
CUDA trainer (``state_sets=3``; the Trainer pipelines states of at most ``PIPELINE_MAX_STATE_MIB``
by default), plus the first step's arena, plus the pattern block (a session that captures CUDA
graphs has none: ``peak_without_pattern_bytes``). It is the graph's own memory. Not modelled:
the fixed overhead of a
CUDA session (cuBLAS/cuDNN handles and workspaces, kernel code; measured for a tiny model by
``benchmarks/memory_check.py``), kernel scratch buffers, the graph optimizations of ORT other
than folding transposes into matmuls and composing transposes, and the buffers ORT's planner
reuses in place for its own kernels (the kernel library's in-place outputs are: ``buffer_reuse``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping
from fractions import Fraction

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph._ir.inplace import inplace_pairs
from mpgraph._ir.ort_order import VIEW_OPS, ort_order
from mpgraph.audit.buffer_reuse import share_input_buffers
from mpgraph.audit.ort_alloc import (
    ARENA_UNIT,
    PATTERN_ALIGNMENT,
    POWER_OF_TWO,  # noqa: F401 - state_arena_bytes' doctest and callers
    SAME_AS_REQUESTED,
)
from mpgraph.audit.ort_alloc import Buffer as _Buffer
from mpgraph.audit.ort_alloc import arena_bytes as _arena_bytes
from mpgraph.audit.ort_alloc import pattern_block as _pattern_block
from mpgraph.errors import MpgraphError, first_line

__all__ = ["MemoryReport", "estimate_memory", "ort_order", "state_arena_bytes", "ROLES", "VIEW_OPS", "PATTERN_ALIGNMENT",
           "ARENA_UNIT"]

#: Roles of the per-parameter table, in print order.
ROLES = ("low_weights", "master_weights", "gradients", "optimizer_state")


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
        output_bytes: Graph outputs (the updated state's second buffers, the loss), less the
            state outputs updated in place.
        extra_state_set_bytes: State sets past the second (a pipelined trainer's third): each
            as large as the state inputs.
        saved_for_backward_bytes: Forward buffers read by a backward node.
        saved_for_backward_values: How many such buffers.
        transient_peak_bytes: Largest sum of live intermediate buffers.
        transient_peak_node: Node at which that peak happens.
        first_step_arena_bytes: What ORT's arena grows by in the first step: the buffers
            allocated one by one, with the arena's fragmentation (``_arena_bytes``).
        pattern_block_bytes: ORT's memory-pattern block: the same buffers packed at fixed offsets
            as ORT's ``MemPatternPlanner`` does (``_pattern_block``).
        estimated_peak_bytes: Persistent + outputs + extra state sets + first-step arena +
            pattern block (ORT's default, ``enable_mem_pattern``; ``peak_without_pattern_bytes``
            without it).
        unknown_shapes: Intermediate values whose shape could not be inferred (not counted).
        nodes: Nodes walked.
        fp8_bytes: fp8 products (``QuantizeFp8Pass``): ``values``, the fp8 operands (1 byte an
            element, each counted once; part of the transient figures) and ``state``, the scales
            and amax histories (part of ``other_state_bytes``); empty without fp8.
        inplace_bytes: State outputs that share their input's buffer (``inplace=True``): not
            in ``output_bytes`` nor in ``extra_state_set_bytes``.
        inplace_refused: State inputs that could not share (``inplace=True``), with the reason.
        arena_strategy: The arena growth modelled (``ort_alloc.ARENA_STRATEGIES``).
        cuda_state_arena_bytes: What the state sets take on CUDA: a Trainer allocates them as
            ``OrtValue``s from onnxruntime's Python CUDA allocator, a BFC arena with its own
            process-wide growth setting (not the session's), which the Trainer sets to
            ``kSameAsRequested`` (``providers.exact_device_values``), one value at a time in the
            step contract's order, every set of a value together (``state_arena_bytes``).
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
    extra_state_set_bytes: int
    saved_for_backward_bytes: int
    saved_for_backward_values: int
    transient_peak_bytes: int
    transient_peak_node: str
    first_step_arena_bytes: int
    pattern_block_bytes: int
    estimated_peak_bytes: int
    unknown_shapes: int
    nodes: int
    fp8_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    inplace_bytes: int = 0
    inplace_refused: dict[str, str] = dataclasses.field(default_factory=dict)
    arena_strategy: str = SAME_AS_REQUESTED
    cuda_state_arena_bytes: int = 0

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


#: Symbolic dimensions up to this value go to shape inference as they are. onnx's data
#: propagation allocates per element of the batch (the tiny MLP's step: 1.3 s and 280 MB at
#: batch 1e6, 8 GB at 1e9), so larger ones are probed at ``PROBES`` and interpolated.
PROBE_LIMIT = 4096
#: Two values each large symbolic dimension takes in the probes, and a third that checks them.
PROBES, PROBE_CHECK = (1024, 2048), 1536


def _shapes(proto: onnx.ModelProto, batch: int, dims: Mapping[str, int]) -> dict[str, tuple[int | None, list[int | None] | None]]:
    """Set symbolic input dims (on a copy), infer shapes: value name -> (item size, dims).

    ``None`` for an unknown item size, shape or dimension."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    for value in (*graph.input, *graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") or not dim.HasField("dim_value"):
                dim.dim_value = int(dims.get(dim.dim_param, batch))
    del graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as e:  # noqa: BLE001 - onnx raises InferenceError and bare RuntimeErrors
        raise MpgraphError(f"shape inference failed at batch {batch}: {first_line(e)}") from None
    shapes: dict[str, tuple[int | None, list[int | None] | None]] = {}
    g = inferred.graph
    for info in (*g.value_info, *g.output, *g.input):
        t = info.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
        if info.name not in shapes or shapes[info.name][1] is None:
            shapes[info.name] = (_itemsize(t.elem_type), shape)
    return shapes


def _interpolated(corners: list[dict[str, tuple[int | None, list[int | None] | None]]], check: Mapping[str, tuple[
        int | None, list[int | None] | None]], large: list[int]) -> dict[str, tuple[int | None, list[int | None] | None]]:
    """Shapes at the ``large`` values from shapes at every corner of ``PROBES`` (one axis per
    large value, first index slowest), each dimension multilinear in them (``batch``,
    ``batch * seq``, ``batch + 1``); a dimension that does not fit (checked against ``check``,
    the shapes with every large value at ``PROBE_CHECK``) or is not a whole number >= 0 is
    unknown."""
    out: dict[str, tuple[int | None, list[int | None] | None]] = {}
    for name, (item, first) in corners[0].items():
        shapes = [c.get(name, (None, None))[1] for c in corners]
        expected = check.get(name, (None, None))[1]
        if first is None or expected is None or any(s is None or len(s) != len(first) for s in shapes):
            out[name] = (item, None)
            continue
        dims: list[int | None] = []
        for axis in range(len(first)):
            at = [s[axis] for s in shapes]  # type: ignore[index]
            if any(v is None for v in at):
                dims.append(None)
                continue
            fits = _multilinear(at, [PROBE_CHECK] * len(large)) == expected[axis]  # type: ignore[arg-type]
            target = _multilinear(at, large)  # type: ignore[arg-type]
            dims.append(int(target) if fits and target.denominator == 1 and target >= 0 else None)
        out[name] = (item, dims)
    return out


def _multilinear(corners: list[int], xs: list[int]) -> Fraction:
    """The multilinear function with these values at the corners of ``PROBES`` (first
    coordinate slowest), at ``xs``, exactly.

    >>> _multilinear([1024, 2048], [10**12]), _multilinear([3, 3], [7])  # batch; a constant
    (Fraction(1000000000000, 1), Fraction(3, 1))
    """
    lo, hi = PROBES
    total = Fraction(0)
    for corner, v in enumerate(corners):
        weight = Fraction(1)
        for i, x in enumerate(xs):
            upper = (corner >> (len(xs) - 1 - i)) & 1
            weight *= Fraction(x - lo, hi - lo) if upper else Fraction(hi - x, hi - lo)
        total += weight * v
    return total


def _concrete(proto: onnx.ModelProto, batch: int, dims: Mapping[str, int]) -> dict[str, int | None]:
    """Bytes per value name (None: unknown) with the symbolic input dims set to ``batch``
    (or ``dims``): by shape inference at those values when they are at most ``PROBE_LIMIT``,
    else arithmetic on shapes inferred at small values (``_interpolated``)."""
    values = {"": batch, **dims}
    large = [k for k, v in values.items() if v > PROBE_LIMIT]
    if not large:
        shapes = _shapes(proto, batch, dims)
    else:
        def probe(x: Mapping[str, int]) -> dict[str, tuple[int | None, list[int | None] | None]]:
            return _shapes(proto, x.get("", batch), {**dims, **{k: v for k, v in x.items() if k}})

        corners = [probe(dict(zip(large, xs))) for xs in itertools.product(PROBES, repeat=len(large))]
        shapes = _interpolated(corners, probe(dict.fromkeys(large, PROBE_CHECK)), [values[k] for k in large])
    sizes: dict[str, int | None] = {}
    for name, (item, shape) in shapes.items():
        known = item is not None and shape is not None and all(d is not None for d in shape)
        sizes[name] = math.prod(shape) * item if known else None  # type: ignore[arg-type, operator]
    for init in proto.graph.initializer:
        sizes[init.name] = math.prod(init.dims) * (_itemsize(init.data_type) or 0)
    return sizes


def _recorded(model: ir.Model) -> dict[str, int | None]:
    """Bytes per value name from the shapes and dtypes the graph records (None: not static)."""
    values = [*model.graph.inputs, *model.graph.initializers.values(), *(v for n in model.graph for v in n.outputs)]
    return {v.name: (math.ceil(math.prod(v.shape.numpy()) * v.dtype.itemsize)  # itemsize: 0.5 for 4-bit types
                     if v.shape is not None and v.dtype is not None and v.shape.is_static() else None)
            for v in values if v.name}


def _per_parameter(model: ir.Model, state: str) -> bool:
    """Optimizer state held per parameter element (moments), not a scalar such as the step."""
    if not state.startswith("optim/"):
        return False
    value = next((v for v in model.graph.inputs if v.name == state), None)
    return value is None or value.shape is None or value.shape.rank() > 0


def _perm(node: ir.Node) -> list[int] | None:
    """A ``Transpose``'s permutation (``None`` when its rank is unknown and ``perm`` is absent)."""
    attr = node.attributes.get("perm")
    if attr is not None:
        return list(attr.as_ints())
    rank = node.inputs[0].shape.rank() if node.inputs[0] is not None and node.inputs[0].shape is not None else None
    return None if rank is None else list(reversed(range(rank)))


def _transpose_source(node: ir.Node) -> tuple[ir.Value, list[int] | None]:
    """What a ``Transpose`` reads once ORT's transpose optimizer has composed it with the
    ``Transpose`` chain that makes its input: the chain's first input and the composed
    permutation. A chain of transposes becomes one transpose of the original tensor, so the
    intermediate transposes are not kept alive by this one."""
    value, perm = node.inputs[0], _perm(node)
    while value is not None and perm is not None and (inner := value.producer()) is not None \
            and inner.op_type == "Transpose" and (inner_perm := _perm(inner)) is not None:
        value, perm = inner.inputs[0], [inner_perm[k] for k in perm]
    return value, perm


def _folded_transpose(node: ir.Node) -> bool:
    """A ``Transpose`` that ORT folds into the matmuls reading it (``MatmulTransposeFusion``,
    ``GemmTransposeFusion``): every consumer is a ``MatMul`` (the last two axes swapped, after
    composing with the transposes before it) or a ``Gemm`` (a 2-D transpose), and it is no graph
    output. ORT removes it, and its consumers read its source with a transpose flag: no buffer.
    The exported ``Linear`` is such a ``Transpose`` of the weight, a copy of every weight kept for
    the backward otherwise."""
    if node.op_type != "Transpose" or node.outputs[0].is_graph_output():
        return False
    perm = _transpose_source(node)[1]
    if perm is None:
        return False
    swaps_last_two = len(perm) >= 2 and perm == [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2]
    uses = [use.node.op_type for use in node.outputs[0].uses()]
    return bool(uses) and swaps_last_two and all(op == "MatMul" or (op == "Gemm" and len(perm) == 2) for op in uses)


def _reads(node: ir.Node) -> list[ir.Value | None]:
    """The values ``node`` reads in ORT: a ``Transpose`` reads its chain's source."""
    return [_transpose_source(node)[0]] if node.op_type == "Transpose" and node.inputs else list(node.inputs)


def _buffers(nodes: list[ir.Node]) -> dict[str, str]:
    """Value name -> name of the buffer it lives in (view ops and folded transposes alias their input)."""
    owner: dict[str, str] = {}
    for node in nodes:
        for value in node.outputs:
            if not value.name:
                continue
            alias = node.op_type in VIEW_OPS or _folded_transpose(node)
            src = _reads(node)[0] if alias and node.inputs and node.inputs[0] is not None else None
            owner[value.name] = owner.get(src.name or "", src.name or "") if src is not None else value.name
    return owner


def _check_request(model: ir.Model, batch: int, state_sets: int) -> StepContract:
    """The step contract of ``model``, which must have gradients (an optimizer)."""
    contract = StepContract.read(model) if StepContract.recorded(model) else None
    if contract is None or contract.gradients is None:
        raise MpgraphError("not a training step graph (no mpgraph.gradients metadata): run train-graph first, "
                           "or pass --optimizer to build one")
    if batch < 1:
        raise MpgraphError(f"batch must be >= 1, got {batch}")
    if state_sets < 2:
        raise MpgraphError(f"state_sets must be >= 2 (the state inputs and outputs), got {state_sets}")
    return contract


def estimate_memory(model: ir.Model, *, batch: int = 1, dims: Mapping[str, int] | None = None,
                    state_sets: int = 2, inplace: bool = False, arena: str = SAME_AS_REQUESTED,
                    recorded_shapes: bool = False) -> MemoryReport:
    """Estimate a training step's memory by role and by liveness.

    Args:
        model: A training step graph (``build_training_graph``), float32 or converted.
        batch: Value of every symbolic input dimension not named in ``dims``.
        dims: Symbolic dimension name -> value (e.g. ``{"seq": 512}``).
        state_sets: Buffer sets the trainer holds the state in: 2 (the inputs and the
            outputs), 3 for a pipelined CUDA trainer (``Trainer.pipeline``).
        inplace: State outputs share their input's buffer where that is safe, as a Trainer
            with ``inplace_state`` binds them (``Trainer.inplace``).
        arena: ORT's ``arena_extend_strategy`` (``kSameAsRequested``, the Trainer's on CUDA,
            or ``kNextPowerOfTwo``, ORT's default).
        recorded_shapes: Take every value's size from the shapes the graph records instead of
            ONNX shape inference (``batch`` and ``dims`` unused): for a session plan specialised to
            its batch (``Trainer.executor.plan``), whose fused ops ONNX cannot infer.

    Raises:
        MpgraphError: Not a training step graph, or shapes cannot be inferred.
    """
    props = model.metadata_props
    contract = _check_request(model, batch, state_sets)
    sizes = _recorded(model) if recorded_shapes else _concrete(ir.to_proto(model), batch, dims or {})
    gradients = list(contract.gradients or ())
    params = {p for p, _ in gradients}
    state_inputs = set(contract.state_inputs)

    def size(name: str) -> int:
        return sizes.get(name) or 0

    n_params = sum((int(np.prod(v.shape.numpy(), dtype=np.int64)) if v.shape.rank() else 1) for v in model.graph.inputs
                   if v.name in params and v.shape is not None and v.shape.is_static())
    roles = {
        "low_weights": _low_copies(model, params, size),
        "master_weights": sum(size(p) for p in params),
        "gradients": sum(size(g) for _, g in gradients),
        "optimizer_state": sum(size(s) for s in state_inputs if s not in params and _per_parameter(model, s)),
    }
    other_state = sum(size(s) for s in state_inputs if s not in params and not _per_parameter(model, s))
    input_names = {v.name for v in model.graph.inputs}
    data = sum(size(v.name or "") for v in model.graph.inputs if v.name not in state_inputs)
    constants = sum(size(n) for n in model.graph.initializers if n not in input_names)
    outputs = {v.name for v in model.graph.outputs}
    shared, shared_outputs, refused = _inplace(model, contract, inplace)
    output_bytes = sum(size(n or "") for n in outputs if n not in shared_outputs)

    buffers, saved, saved_n, unknown = _walk(nodes := ort_order(model), sizes, outputs)
    (peak, peak_node), block, grown = _peak(buffers, nodes), _pattern_block(buffers), _arena_bytes(buffers, arena)
    persistent = roles["master_weights"] + roles["optimizer_state"] + other_state + data + constants
    extra_sets = (state_sets - 2) * sum(size(s) for s in state_inputs if s not in shared)
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
        extra_state_set_bytes=extra_sets,
        saved_for_backward_bytes=saved,
        saved_for_backward_values=saved_n,
        transient_peak_bytes=peak,
        transient_peak_node=peak_node,
        first_step_arena_bytes=grown,
        pattern_block_bytes=block,
        estimated_peak_bytes=persistent + output_bytes + extra_sets + grown + block,
        unknown_shapes=unknown,
        nodes=len(model.graph),
        fp8_bytes=_fp8_bytes(model, size),
        inplace_bytes=sum(size(b) for b in shared_outputs),
        inplace_refused=refused,
        arena_strategy=arena,
        cuda_state_arena_bytes=state_arena_bytes(
            [size(a) for a, _ in contract.state_pairs], [1 if a in shared else state_sets for a, _ in contract.state_pairs]),
    )


def state_arena_bytes(sizes: list[int], sets: list[int], strategy: str = SAME_AS_REQUESTED) -> int:
    """Bytes of the arena that holds ``sets[i]`` buffers of ``sizes[i]`` bytes, allocated in order
    and never freed (a CUDA Trainer's state sets), growing by ``strategy``: ``kSameAsRequested``,
    as the Trainer sets it (``providers.exact_device_values``), or ``kNextPowerOfTwo``, ORT's
    default for device values made from Python.

    >>> state_arena_bytes([768 << 10], [2], POWER_OF_TWO)  # a 1 MiB region, then 2 MiB
    3145728
    >>> state_arena_bytes([768 << 10], [2])
    1572864
    """
    buffers, k = [], 0
    for nbytes, count in zip(sizes, sets):
        for _ in range(count):
            buffers.append(_Buffer(str(k), k, len(sizes) * max(sets, default=1) + 1, nbytes))
            k += 1
    return _arena_bytes(buffers, strategy)


def _low_copies(model: ir.Model, params: set[str], size: Callable[[str], int]) -> int:
    """Bytes of the low-precision copies of parameters (a policy's ``Cast`` of one, not a rounding)."""
    return sum(size(node.outputs[0].name or "") for node in model.graph
               if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None and node.inputs[0].name in params
               and node.metadata_props.get(md.NODE_INSERTED) != "round")


def _inplace(model: ir.Model, contract: StepContract, inplace: bool) -> tuple[set[str], set[str], dict[str, str]]:
    """The state inputs and outputs that share a buffer (``inplace``), and why the others do not."""
    if not inplace:
        return set(), set(), {}
    shared, refused = inplace_pairs(model.graph, contract.state_pairs)
    return set(shared), {b for a, b in contract.state_pairs if a in set(shared)}, refused


def _fp8_bytes(model: ir.Model, size: Callable[[str], int]) -> dict[str, int]:
    """``MemoryReport.fp8_bytes``: the fp8 operand values and the fp8 scale state."""
    if md.MODEL_FP8 not in model.metadata_props:
        return {}
    state = StepContract.read(model).fp8_state
    values = {v.name for node in model.graph for v in node.outputs
              if v.name and v.dtype is not None and v.dtype.itemsize == 1 and v.dtype.is_floating_point()}
    return {"values": sum(size(n) for n in values), "state": sum(size(n) for n in state)}


def _walk(
    nodes: list[ir.Node], sizes: Mapping[str, int | None], outputs: set[str | None]
) -> tuple[list[_Buffer], int, int, int]:
    """Buffers of the intermediates (not outputs) in ``nodes``' order, and the saved-for-backward
    bytes, their count and the intermediates of unknown size."""
    owner = share_input_buffers(nodes, _buffers(nodes), _reads, outputs)
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
        for value in _reads(node):
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
