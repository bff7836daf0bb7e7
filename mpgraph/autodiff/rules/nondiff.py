"""Ops declared non-differentiable: their outputs stop gradient paths."""

from __future__ import annotations

from mpgraph.autodiff.registry import non_differentiable

__all__: list[str] = []

non_differentiable(
    "Shape", "Size", "NonZero", "ArgMax", "ArgMin", "Range", "ConstantOfShape", "Constant",
    "EyeLike", "OneHot", reason="shape, index or constant output",
)
non_differentiable(
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", reason="boolean output",
)
non_differentiable(
    "Floor", "Ceil", "Round", "Sign", reason="piecewise constant: zero gradient almost everywhere"
)
non_differentiable(
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
    "Multinomial", reason="random sample, independent of the inputs' values",
)
