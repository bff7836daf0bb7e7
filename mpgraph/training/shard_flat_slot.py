"""A packed optimizer slot updated in N contiguous slices: ZeRO-1 over a flat buffer.

A packed (or ``flat=True``) optimizer updates many parameters as one flat vector of ``S``
elements: its moments are state inputs of shape ``[S]``, the update is elementwise, and a
``Split`` (a tree of them) cuts the new flat parameter back into the parameters. Sharded
by whole groups (``optimizer_groups``), such a slot lands on one rank. Here each rank
updates ``S / N`` elements of it instead:

1. **Find the slots** (``flat_slots``): a ``Split`` whose outputs reach only parameter
   outputs, through inner Splits, Reshapes and Identities (so nothing but data movement
   follows the update), with at least one ``[S]`` state input beside its parameters (the
   moments). The members are the parameters in the order the Split tree gives them, which
   is their order in the flat buffer.
2. **Slice** (``shard_flat_slots``): each ``[S]`` state input becomes an input of this rank's
   ``[b - a]`` elements (``slice_range``). Every node that reads a sliced value is sliced:
   its other ``[S]`` operands (and 1-D ones of unknown length) get a ``Slice(a, b)`` (the
   flat parameter, the flat gradient the optimizer reads; the finite check keeps reading the
   whole gradient), and scalars broadcast as before. Elementwise, so each element is computed by the same ops on the
   same numbers as in the whole update: bit for bit.
3. **Stop at the Split**: its sliced input, the rank's slice of the new flat parameter,
   becomes the output ``zero/<slot>/param``; the member parameters' outputs are dropped
   (the runner gathers the slices and unpacks them).

A slot whose parameters are guarded after the Split (an SGD step under loss scaling
selects each parameter back on its own) is not found by rule 1, and is sharded whole.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.builder import Builder

__all__ = ["FlatSlot", "flat_slots", "shard_flat_slots", "slice_range"]

_MOVES = frozenset({"Split", "Reshape", "Identity"})
#: Ops whose every output element depends on the same element of each input (or a scalar).
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Neg", "Abs", "Sign", "Pow", "Max", "Min",
                          "Where", "Cast", "Identity", "Clip", "Exp", "Log", "IsNaN", "IsInf", "Not", "And", "Or",
                          "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"})


@dataclasses.dataclass(frozen=True)
class FlatSlot:
    """A packed slot: its ``[size]`` state inputs, its parameters ``(name, elements)`` in
    flat order, and the name of the value its Split reads (the new flat parameter)."""

    state: tuple[str, ...]
    members: tuple[tuple[str, int], ...]
    size: int
    flat: str

    @property
    def output(self) -> str:
        """The output a sharded apply part gives this rank's slice of the new parameter as."""
        return f"zero/{self.state[0]}/param"


def slice_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``size`` elements: the first ``size % world``
    ranks take one more.

    Example:
        >>> [slice_range(7, r, 3) for r in range(3)]
        [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def flat_slots(apply: ir.Model, pairs: list[tuple[str, str]], params: set[str]) -> list[FlatSlot]:
    """Rule 1: the packed slots of an apply part (``split_step_graph``'s)."""
    graph = apply.graph
    param_of = {out: a for a, out in pairs if a in params}
    inputs = {v.name: v for v in graph.inputs}
    outputs = set(graph.outputs)
    slots = []
    for node in graph:
        if node.op_type != "Split" or _is_inner_split(node):
            continue
        members = _members(node, outputs, param_of)
        flat = node.inputs[0]
        size = _size(flat)
        if not members or flat is None or size is None or size != sum(n for _, n in members):
            continue
        readers = _ancestors_inputs(flat)
        state = tuple(a for a, _ in pairs if a not in params and a in readers and _size(inputs.get(a)) == size)
        if state and _elementwise_from(graph, {inputs[a] for a in state}, flat):
            slots.append(FlatSlot(state, tuple(members), size, flat.name or ""))
    return slots


def _elementwise_from(graph: ir.Graph, start: set[ir.Value], stop: ir.Value) -> bool:
    """Whether every node downstream of ``start`` (up to the Split reading ``stop``) is
    elementwise, so slicing its operands slices its result (a norm of the moments would not)."""
    reached = set(start)
    for node in graph:
        if stop in node.inputs or not any(v in reached for v in node.inputs):
            continue
        if node.op_type not in _ELEMENTWISE:
            return False
        reached.update(node.outputs)
    return True


def shard_flat_slots(model: ir.Model, slots: list[FlatSlot], rank: int, world: int) -> None:
    """Rules 2-3, in place on a copy of the apply part: each slot's state sliced to this
    rank's range, the new flat parameter's slice an output, the members' outputs dropped."""
    graph = model.graph
    values = {v.name: v for v in (*graph.inputs, *(o for n in graph for o in n.outputs))}
    b = Builder(graph, role=md.Role.OPTIMIZER, scope="zero")
    dropped: set[str] = set()
    for slot in slots:
        start, end = slice_range(slot.size, rank, world)
        sliced = {_slice_input(graph, values[name], end - start) for name in slot.state}
        stop = values[slot.flat]
        for node in list(graph):
            if any(v in sliced for v in node.inputs) and stop not in node.inputs:
                _slice_node(b, node, sliced, slot.size, start, end)
        stop.name = slot.output
        graph.outputs.append(stop)
        dropped |= {p for p, _ in slot.members}
    kept = [v for v in graph.outputs if (v.name or "").removesuffix("/updated") not in dropped]
    graph.outputs.clear()
    graph.outputs.extend(kept)
    graph.sort()


def _slice_input(graph: ir.Graph, old: ir.Value, size: int) -> ir.Value:
    """The state input replaced by one of ``size`` elements (same name, no initializer)."""
    new = ir.Value(name=old.name, type=old.type, shape=ir.Shape([size]))
    old.replace_all_uses_with(new)
    graph.inputs[graph.inputs.index(old)] = new
    graph.initializers.pop(old.name or "", None)
    return new


def _slice_node(b: Builder, node: ir.Node, sliced: set[ir.Value], size: int, start: int, end: int) -> None:
    """Rule 2 on one node: its whole ``[size]`` operands sliced, its outputs marked sliced."""
    for i, value in enumerate(node.inputs):
        if value is not None and value not in sliced and _whole(value, size):
            part = b.op("Slice", value, b.ints([start]), b.ints([end]), b.ints([0]))
            part.shape = ir.Shape([end - start])
            node.replace_input_with(i, part)
    for out in node.outputs:
        sliced.add(out)
        if _size(out) == size:
            out.shape = ir.Shape([end - start])


def _whole(value: ir.Value, size: int) -> bool:
    """Whether an operand beside a sliced one is a whole ``[size]`` vector: its shape says so,
    or it is 1-D of unknown length (the flat gradient of a packed slot, whose parameters'
    gradients have symbolic shapes); scalars and other static shapes broadcast."""
    shape = value.shape
    if shape is None:
        return True
    return _size(value) == size or (len(shape) == 1 and not isinstance(shape[0], int))


def _is_inner_split(node: ir.Node) -> bool:
    source = node.inputs[0].producer() if node.inputs[0] is not None else None
    return source is not None and source.op_type == "Split"


def _members(split: ir.Node, outputs: set[ir.Value], param_of: dict[str, str]) -> list[tuple[str, int]] | None:
    """The parameters a Split tree makes, in its output order; ``None`` when an output goes
    anywhere but, through data movement, to one parameter output."""
    members: list[tuple[str, int]] = []
    for part in split.outputs:
        value = part
        while value not in outputs:
            uses = list(value.uses())
            if len(uses) != 1 or uses[0].node.op_type not in _MOVES:
                return None
            reader = uses[0].node
            if reader.op_type == "Split":
                inner = _members(reader, outputs, param_of)
                if inner is None:
                    return None
                members += inner
                break
            value = reader.outputs[0]
        else:
            if value.name not in param_of or len(list(value.uses())):
                return None
            size = _size(value)
            if size is None:
                return None
            members.append((param_of[value.name], size))
    return members


def _size(value: ir.Value | None) -> int | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return int(np.prod([int(d) for d in value.shape], dtype=np.int64))


def _ancestors_inputs(value: ir.Value) -> set[str]:
    """Names of the graph inputs a value is computed from."""
    seen: set[ir.Node] = set()
    names: set[str] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        producer = v.producer()
        if producer is None:
            names.add(v.name or "")
        elif producer not in seen:
            seen.add(producer)
            stack.extend(x for x in producer.inputs if x is not None)
    return names
