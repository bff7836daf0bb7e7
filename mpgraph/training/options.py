"""Optimizer options from the ``train-graph`` flags, checked against the optimizer."""

from __future__ import annotations

from typing import Any

from mpgraph.errors import MpgraphError

__all__ = ["optimizer_options"]


def optimizer_options(
    optimizer: str,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float | None = None,
    amsgrad: bool = False,
    flat: bool = False,
) -> dict[str, Any]:
    """``optimizer_options`` for ``build_training_graph``; ``None`` values mean the default.

    Raises:
        MpgraphError: ``nesterov`` without sgd, or ``amsgrad`` with sgd.

    Example:
        >>> optimizer_options("adamw", momentum=0.9, amsgrad=True)
        {'weight_decay': None, 'amsgrad': True}
        >>> optimizer_options("sgd", momentum=0.9, nesterov=True)
        {'momentum': 0.9, 'weight_decay': None, 'nesterov': True}
    """
    options: dict[str, Any] = {"momentum": momentum, "weight_decay": weight_decay}
    if nesterov:
        options["nesterov"] = True
    if optimizer.lower() != "sgd":
        options.pop("momentum")
        if nesterov:
            raise MpgraphError("--nesterov applies to --optimizer sgd only")
    if amsgrad:
        if optimizer.lower() == "sgd":
            raise MpgraphError("--amsgrad applies to --optimizer adam and adamw only")
        options["amsgrad"] = True
    if flat:
        options["flat"] = True
    return options
