"""The optimizer interface shared by the step builders."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.errors import GradientError
from mpgraph.metadata import FLAT_GRADIENT, FLAT_PARAM, FLAT_SPLIT, NODE_FLAT

__all__ = ["Optimizer", "StateFactory", "OPTIMIZERS", "make_optimizer", "slots"]

#: ``factory(name, like, init)`` creates a state graph input shaped like ``like`` (``None``:
#: a scalar) filled with ``init``, and returns it; the caller pairs it with its update.
StateFactory = Callable[[str, "ir.Value | None", float], ir.Value]


class Optimizer(Protocol):
    """Builds one optimizer step into a graph."""

    def build(
        self,
        ctx: GradContext,
        params: list[tuple[ir.Value, ir.Value]],
        lr: ir.Value,
        state: StateFactory,
    ) -> tuple[dict[str, ir.Value], list[tuple[ir.Value, ir.Value]]]:
        """Emit the update.

        Args:
            ctx: Node builder (role ``optimizer``, scope ``optim``).
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


def slots(ctx: GradContext, params: list[tuple[ir.Value, ir.Value]], *, pack_small: bool, flat: bool) -> list[Slot]:
    """The slots an optimizer updates, per its ``pack`` and ``flat`` options.

    ``flat`` puts every static-shape float32 parameter into one slot (the multi-tensor form of
    Apex and DeepSpeed): the update is a constant number of nodes whatever the parameter count.
    Otherwise ``pack_small`` packs parameters below ``PACK_BELOW`` elements, and the rest are
    updated one by one.
    """
    if flat:
        members = [(p, g) for p, g in params if _numel(p) and p.dtype in (ir.DataType.FLOAT, None)]
        return pack(ctx, params, members=members, mark=True)
    return pack(ctx, params) if pack_small else pack(ctx, params, threshold=0)


def pack(
    ctx: GradContext, params: list[tuple[ir.Value, ir.Value]], threshold: int = PACK_BELOW, *,
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
        flat = ctx.ints([-1])
        param = ctx.op("Concat", *[ctx.op("Reshape", p, flat) for p, _ in small], axis=0)
        grad = ctx.op("Concat", *[ctx.op("Reshape", g, flat) for _, g in small], axis=0)
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


def unpack(ctx: GradContext, slot: Slot, new_param: ir.Value) -> dict[str, ir.Value]:
    """``{param name: updated value}`` of a slot."""
    if slot.members is None:
        return {slot.name: new_param}
    sizes = [_numel(p) or 0 for p in slot.members]
    parts = ctx.op_multi("Split", new_param, ctx.ints(sizes), axis=0, num_outputs=len(sizes))
    if slot.marked:
        split = parts[0].producer()
        assert split is not None
        split.metadata_props[NODE_FLAT] = FLAT_SPLIT
    updated = {}
    for p, part in zip(slot.members, parts, strict=True):
        dims = [d if isinstance(d, int) else -1 for d in p.shape or ()]
        if slot.marked and len(dims) == 1:
            # A Reshape at a graph output is a copy on ORT CPU (1.6 ms/step for the wide MLP's
            # 2.1M parameters): vectors take the Split's output as it is.
            part.shape = ir.Shape(dims)
            updated[p.name or ""] = part
        else:
            updated[p.name or ""] = ctx.op("Reshape", part, ctx.ints(dims))
    return updated
