"""The BatchNorm lowerings ``export_module`` hands to ``torch.onnx.export``.

torchlib (onnxscript 0.7) lowers train-mode ``aten._native_batch_norm_legit_functional`` to
an inference ``BatchNormalization`` (it hard-codes ``training = False``); these lowerings
honour ``training``: ``batch_norm="node"`` gives ``BatchNormalization(training_mode=1)`` over
the running statistics, ``batch_norm="ops"`` the batch statistics as explicit ops (see
``mpgraph.export``'s docstring for both forms and why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["batch_norm_translation"]


def batch_norm_translation(torch: Any, batch_norm: str) -> dict[Any, Callable[..., Any]]:
    """Lowerings of aten's batch norm ops that honour ``training`` (torchlib ignores it)."""
    from onnxscript import opset18

    # Traced, not type-checked: onnxscript's opset stubs do not accept python scalars.
    op: Any = opset18

    def lower(
        input: Any,
        weight: Any = None,
        bias: Any = None,
        running_mean: Any = None,
        running_var: Any = None,
        training: bool = False,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> tuple[Any, ...]:
        stats = (running_mean, running_var)
        return _lower_batch_norm(op, batch_norm, input, (weight, bias), stats, training, momentum, eps)

    def lower_legit(
        input: Any,
        weight: Any,
        bias: Any,
        running_mean: Any,
        running_var: Any,
        training: bool,
        momentum: float,
        eps: float,
    ) -> tuple[Any, ...]:
        return lower(input, weight, bias, running_mean, running_var, training, momentum, eps)[:3]

    def lower_no_stats(
        input: Any, weight: Any, bias: Any, training: bool, momentum: float, eps: float
    ) -> tuple[Any, ...]:
        return lower(input, weight, bias, None, None, training, momentum, eps)[:3]

    aten = torch.ops.aten
    return {
        aten._native_batch_norm_legit_functional.default: lower,
        aten._native_batch_norm_legit.default: lower_legit,
        aten._native_batch_norm_legit.no_stats: lower_no_stats,
        aten.native_batch_norm.default: lower_legit,
    }


def _lower_batch_norm(
    op: Any,
    batch_norm: str,
    input: Any,
    affine: tuple[Any, Any],
    stats: tuple[Any, Any],
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Any, ...]:
    """aten's five batch norm outputs: normalised input, batch mean, batch inverse std, and
    the running mean and variance torch would store.

    An eval-mode BatchNorm with running statistics is an inference ``BatchNormalization``;
    without running statistics torch normalises with batch ones, as in train mode. Train
    mode normalises with batch statistics, as one ``BatchNormalization(training_mode=1)``
    node (``batch_norm="node"``) or as explicit ops (``"ops"``).
    """
    running_mean, running_var = stats
    rank = len(input.shape)
    channels = op.Shape(input, start=1, end=2)
    axes = op.Constant(value_ints=[0, *range(2, rank)])
    if not training and running_mean is not None and running_var is not None:
        weight, bias = _default_affine(op, input, channels, affine)
        norm = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps)
        invstd = op.Reciprocal(op.Sqrt(op.Add(running_var, op.CastLike(eps, input))))
        return norm, running_mean, invstd, running_mean, running_var

    mean = op.ReduceMean(input, axes)  # keepdims: [1, C, 1, ...]
    centered = op.Sub(input, mean)
    var = op.ReduceMean(op.Mul(centered, centered), axes)
    invstd = op.Reciprocal(op.Sqrt(op.Add(var, op.CastLike(eps, input))))
    if batch_norm == "node":
        weight, bias = _default_affine(op, input, channels, affine)
        # Without running statistics these inputs only feed the unused running outputs.
        stats_mean = running_mean if running_mean is not None else op.Squeeze(mean, axes)
        stats_var = running_var if running_var is not None else op.Squeeze(var, axes)
        norm, _, _ = op.BatchNormalization(
            input,
            weight,
            bias,
            stats_mean,
            stats_var,
            epsilon=eps,
            momentum=1.0 - momentum,  # ONNX weights the old value, torch the new one
            training_mode=1,
        )
    else:
        norm = _affine_ops(op, op.Mul(centered, invstd), affine, rank)
    mean = op.Squeeze(mean, axes)
    var = op.Squeeze(var, axes)
    invstd = op.Squeeze(invstd, axes)
    if running_mean is None or running_var is None:
        return norm, mean, invstd, mean, var
    new_mean, new_var = _running_statistics(op, input, channels, (mean, var), stats, momentum)
    return norm, mean, invstd, new_mean, new_var


def _default_affine(op: Any, input: Any, channels: Any, affine: tuple[Any, Any]) -> tuple[Any, Any]:
    """Weight and bias for a ``BatchNormalization`` node: ones and zeros where torch has none."""
    weight, bias = affine
    if weight is None:
        weight = op.Expand(op.CastLike(1.0, input), channels)
    if bias is None:
        bias = op.Expand(op.CastLike(0.0, input), channels)
    return weight, bias


def _affine_ops(op: Any, norm: Any, affine: tuple[Any, Any], rank: int) -> Any:
    """``norm * weight + bias`` with the per-channel vectors shaped ``[C, 1, ...]``."""
    weight, bias = affine
    column = op.Constant(value_ints=[-1, *([1] * (rank - 2))])
    if weight is not None:
        norm = op.Mul(norm, op.Reshape(weight, column) if rank > 2 else weight)
    if bias is not None:
        norm = op.Add(norm, op.Reshape(bias, column) if rank > 2 else bias)
    return norm


def _running_statistics(
    op: Any, input: Any, channels: Any, batch: tuple[Any, Any], stats: tuple[Any, Any], momentum: float
) -> tuple[Any, Any]:
    """The running mean and variance torch would store (unused: the graph does not output
    them): ``momentum`` times the batch's (variance unbiased) plus the rest times the old."""
    mean, var = batch
    running_mean, running_var = stats
    count = op.CastLike(op.Div(op.Size(input), op.Squeeze(channels)), input)
    unbiased = op.Mul(var, op.Div(count, op.Sub(count, op.CastLike(1.0, input))))
    new_mean = op.Add(
        op.Mul(op.CastLike(momentum, input), mean),
        op.Mul(op.CastLike(1.0 - momentum, input), running_mean),
    )
    new_var = op.Add(
        op.Mul(op.CastLike(momentum, input), unbiased),
        op.Mul(op.CastLike(1.0 - momentum, input), running_var),
    )
    return new_mean, new_var
