"""The optimizer interface shared by the step builders."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import FLAT_GRADIENT, FLAT_PARAM, FLAT_SPLIT, NODE_FLAT
from mpgraph.errors import GradientError

__all__ = ["Optimizer", "StateFactory", "OPTIMIZERS", "make_optimizer", "slots"]

#: ``factory(name, like, init)`` creates a state graph input shaped like ``like`` (``None``:
#: a scalar) filled with ``init``, and returns it; the caller pairs it with its update.
StateFactory = Callable[[str, "ir.Value | None", float], ir.Value]


class Optimizer(Protocol):
    """Builds one optimizer step into a graph."""

    def build(
        self,
        b: Builder,
        params: list[tuple[ir.Value, ir.Value]],
        lr: ir.Value,
        state: StateFactory,
    ) -> tuple[dict[str, ir.Value], list[tuple[ir.Value, ir.Value]]]:
        """Emit the update.

        Args:
            b: Node builder (role ``optimizer``, scope ``optim``).
            params: ``(parameter input, its gradient)`` pairs.
            lr: Scalar fp32 learning-rate input.
            state: Factory for optimizer state inputs.

        Returns:
            ``{param name: updated value}`` and ``(state input, updated value)`` pairs.
        """
        ...


OPTIMIZERS: dict[str, type] = {}


def make_optimizer(name: str, **options: Any) -> Optimizer:
    """Instantiate an optimizer by name (``sgd``, ``adam``, ``adamw``), ignoring ``None`` options.

    Raises:
        GradientError: Unknown name or option.
    """
    cls = OPTIMIZERS.get(name.lower())
    if cls is None:
        raise GradientError(f"unknown optimizer '{name}'; choose one of {', '.join(sorted(OPTIMIZERS))}")
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in options.items() if v is not None}
    bad = sorted(set(given) - fields)
    if bad:
        raise GradientError(f"optimizer '{name}' has no option {bad[0]}; valid: {', '.join(sorted(fields))}")
    return cls(**given)


#: Parameters with fewer elements than this are updated together as one flat vector.
PACK_BELOW = 1 << 16


@dataclasses.dataclass
class Slot:
    """What an optimizer updates: one parameter, or several packed flat.

    Packing trades one Concat/Split copy for running each elementwise op of the update once
    instead of once per parameter: small models are bound by per-node overhead, not bytes.

    Attributes:
        name: ``<param>`` or ``flat`` (state is named ``optim/<name>/<slot state>``).
        param: Current value (a parameter, or the flat concatenation).
        grad: Its gradient.
        members: The packed parameters, or ``None`` for a single parameter.
        marked: The flat buffers carry ``NODE_FLAT`` metadata (flat mode), so loss scaling
            unscales, checks and guards the flat buffers instead of every member.
    """

    name: str
    param: ir.Value
    grad: ir.Value
    members: list[ir.Value] | None = None
    marked: bool = False


def _numel(value: ir.Value) -> int | None:
    dims = list(value.shape) if value.shape is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    n = 1
    for d in dims:
        n *= d if isinstance(d, int) else 0
    return n


def slots(b: Builder, params: list[tuple[ir.Value, ir.Value]], *, pack_small: bool, flat: bool) -> list[Slot]:
    """The slots an optimizer updates, per its ``pack`` and ``flat`` options.

    ``flat`` puts every static-shape float32 parameter into one slot (the multi-tensor form of
    Apex and DeepSpeed): the update is a constant number of nodes whatever the parameter count.
    Otherwise ``pack_small`` packs parameters below ``PACK_BELOW`` elements, and the rest are
    updated one by one.
    """
    if flat:
        members = [(p, g) for p, g in params if _numel(p) and p.dtype in (ir.DataType.FLOAT, None)]
        if FLAT_UNPACK == "grouped":
            # Parameters with the same trailing dims sit next to each other (see ``unpack``).
            order = {key: i for i, key in reversed(list(enumerate(_trailing(p) for p, _ in members)))}
            members.sort(key=lambda pair: order[_trailing(pair[0])])
        return pack(b, params, members=members, mark=True)
    return pack(b, params) if pack_small else pack(b, params, threshold=0)


def pack(
    b: Builder, params: list[tuple[ir.Value, ir.Value]], threshold: int = PACK_BELOW, *,
    members: list[tuple[ir.Value, ir.Value]] | None = None, mark: bool = False,
) -> list[Slot]:
    """Group small static-shape parameters (or ``members``) into one flat slot; others stay separate.

    With ``mark``, the flat gradient, flat parameter and the Split of the update carry
    ``NODE_FLAT`` metadata, and a single member still makes a flat slot.
    """
    if members is None:
        small = [(p, g) for p, g in params if (_numel(p) or threshold) < threshold]
        if len(small) < 2:
            small = []
    else:
        small = members
    chosen = {id(p) for p, _ in small}
    result = [Slot(p.name or "", p, g) for p, g in params if id(p) not in chosen]
    if small:
        flat = b.ints([-1])
        param = _concat(b, [b.op("Reshape", p, flat) for p, _ in small])
        grad = _concat(b, [b.op("Reshape", g, flat) for _, g in small])
        param.shape = ir.Shape([sum(_numel(p) or 0 for p, _ in small)])
        if mark:
            grad.shape = param.shape
            for value, buffer in ((param, FLAT_PARAM), (grad, FLAT_GRADIENT)):
                value.dtype = ir.DataType.FLOAT
                producer = value.producer()
                assert producer is not None
                producer.metadata_props[NODE_FLAT] = buffer
        result.append(Slot("flat", param, grad, [p for p, _ in small], marked=mark))
    return result


#: ORT's CUDA Concat and Split take at most 32 inputs/outputs while a CUDA graph is captured
#: ("CUDA Concat supports at most 32 inputs during CUDA Graph capture", measured with ORT
#: 1.31.1 on the H200): wider ones are built as a two-level tree.
MAX_FANOUT = 32


def _concat(b: Builder, values: list[ir.Value]) -> ir.Value:
    """``Concat(values, axis=0)``; the last node made is the one producing the result."""
    if len(values) > MAX_FANOUT:
        values = [_concat(b, values[i:i + MAX_FANOUT]) for i in range(0, len(values), MAX_FANOUT)]
    return values[0] if len(values) == 1 else b.op("Concat", *values, axis=0)


def _split(b: Builder, value: ir.Value, sizes: list[int], trailing: tuple[int, ...] = ()) -> tuple[list[ir.Value], ir.Node]:
    """``Split(value, sizes, axis=0)`` as a tree of <= ``MAX_FANOUT`` outputs, and its root;
    ``trailing``: the dims of ``value`` after the first."""
    if len(sizes) <= MAX_FANOUT:
        parts = b.op_multi("Split", value, b.ints(sizes), axis=0, num_outputs=len(sizes))
        root = parts[0].producer()
        assert root is not None
        return list(parts), root
    groups = [sizes[i:i + MAX_FANOUT] for i in range(0, len(sizes), MAX_FANOUT)]
    heads, root = _split(b, value, [sum(g) for g in groups], trailing)
    parts = []
    for head, group in zip(heads, groups, strict=True):
        head.shape = ir.Shape([sum(group), *trailing])
        parts += _split(b, head, group, trailing)[0] if len(group) > 1 else [head]
    return parts, root


#: How a flat optimizer's updated parameter becomes the parameters.
#: ``reshape``: one Split into 1-D pieces, and a Reshape for each non-vector, which copies
#: (ORT writes a graph output through a Reshape by copying).
#: ``grouped``: parameters grouped by trailing dims in the flat buffer; one Split into the
#: groups, and per group one Split of its rows into the parameters' shapes: fewer nodes
#: (7 instead of about 55 for the H200 GPT's 101 tensors), but the group Split copies too.
#: ORT CPU, 1 thread, process time, interleaved, two runs (zoo GPT 110K parameters / wide
#: MLP 2.1M): reshape 15.9 / 19.9 and 14.2 / 20.8 ms/step, grouped 17.0 / 20.5 and 15.4 /
#: 20.6 (the one-off A/B ``benchmarks/optim_ab.py`` at dcc1f1e): ``reshape`` is the default
#: until a CUDA A/B says otherwise.
FLAT_UNPACK = "reshape"


def _trailing(value: ir.Value) -> tuple[int, ...]:
    """The static dims after the first (``()`` for scalars and vectors)."""
    return tuple(int(d) for d in list(value.shape or ())[1:])


def _unpack_grouped(b: Builder, slot: Slot, new_param: ir.Value) -> dict[str, ir.Value]:
    """Flat mode: one Split into runs of members with equal trailing dims, then per run one
    Split of its rows, ``Reshape(run, [-1, *trailing])`` first (a view: not a graph output).
    The pieces have their parameters' shapes, so they are the outputs as they are: a Reshape
    at a graph output is a copy on ORT (0.65 ms/step of the wide MLP's 1.9 ms of copies on
    CPU)."""
    assert slot.members is not None
    runs: list[list[ir.Value]] = []
    for p in slot.members:
        if runs and _trailing(runs[-1][0]) == _trailing(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    sizes = [sum(_numel(p) or 0 for p in run) for run in runs]
    # ``first``: the node reading the updated flat parameter (loss scaling guards its input).
    first: ir.Node | None = None
    segments = [new_param]
    if len(runs) > 1:
        segments, first = _split(b, new_param, sizes)
    updated: dict[str, ir.Value] = {}
    for run, segment, size in zip(runs, segments, sizes, strict=True):
        trailing = _trailing(run[0])
        segment.shape = ir.Shape([size])
        if trailing:
            segment = b.op("Reshape", segment, b.ints([-1, *trailing]))
            segment.shape = ir.Shape([size // math.prod(trailing), *trailing])
        rows = [int(p.shape[0]) if p.shape is not None and len(p.shape) else 1 for p in run]
        parts, root = [segment], None
        if len(run) > 1:
            parts, root = _split(b, segment, rows, trailing)
        if first is None:
            first = segment.producer() if trailing else root
        for p, part, n in zip(run, parts, rows, strict=True):
            part.shape = ir.Shape([n, *trailing])
            if p.shape is not None and len(p.shape) == 0:
                part = b.op("Reshape", part, b.ints([]))
            updated[p.name or ""] = part
    if first is not None:  # None: a single vector, the update itself is the output
        first.metadata_props[NODE_FLAT] = FLAT_SPLIT
    return updated


def unpack(b: Builder, slot: Slot, new_param: ir.Value) -> dict[str, ir.Value]:
    """``{param name: updated value}`` of a slot."""
    if slot.members is None:
        return {slot.name: new_param}
    if slot.marked and FLAT_UNPACK == "grouped":
        return _unpack_grouped(b, slot, new_param)
    sizes = [_numel(p) or 0 for p in slot.members]
    parts, top = _split(b, new_param, sizes)
    if slot.marked:
        top.metadata_props[NODE_FLAT] = FLAT_SPLIT
    updated = {}
    for p, part in zip(slot.members, parts, strict=True):
        dims = [d if isinstance(d, int) else -1 for d in p.shape or ()]
        if slot.marked and len(dims) == 1:
            # A Reshape at a graph output is a copy on ORT: vectors take the Split's output.
            part.shape = ir.Shape(dims)
            updated[p.name or ""] = part
        else:
            updated[p.name or ""] = b.op("Reshape", part, b.ints(dims))
    return updated
