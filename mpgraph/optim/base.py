"""The optimizer interface shared by the step builders."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import onnx_ir as ir

from mpgraph.autodiff.driver import GradContext
from mpgraph.errors import GradientError

__all__ = ["Optimizer", "StateFactory", "OPTIMIZERS", "make_optimizer"]

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
