"""The ``fp8:`` section of a policy: formats of matrix-product inputs and their scaling recipe.

Schema (every key optional; an extending file replaces the keys it gives)::

    fp8:
      ops: [MatMul, Gemm]          # op types whose data inputs are quantised
      products: all                # all | linear: only products with a weight operand, and their backward
      forward: float8e4m3fn        # activations and weights: float8e4m3fn | float8e5m2 (e4m3, e5m2)
      backward: float8e5m2         # gradients read by the backward products
      scaling:
        recipe: delayed            # delayed | current
        history: 1024              # amax history length (delayed)
        amax: max                  # max | most_recent: how the history is reduced (delayed)
        margin: 0                  # scale = fp8_max / amax / 2**margin
        rounding: pow2             # pow2 | none: the scale rounded down to a power of two

``fp8: false`` turns off what an ``extends`` base set.

Example:
    >>> from mpgraph.policy import parse_policy
    >>> parse_policy("extends: bf16\\nfp8: {scaling: {recipe: current}}").fp8.scaling.recipe
    'current'
    >>> parse_policy("extends: bf16\\nfp8: {forward: e4m4}")
    Traceback (most recent call last):
    ...
    mpgraph.errors.PolicyError: <string>:2: fp8.forward: invalid value 'e4m4' (did you mean 'e4m3'?); valid: float8e4m3fn, e4m3, float8e5m2, e5m2
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir

from mpgraph.policy.schema import (
    AMAX_COMPUTE,
    FP8_FORMATS,
    FP8_PRODUCTS,
    SCALE_ROUNDING,
    SCALING_RECIPES,
    Fp8,
    Fp8Scaling,
    Policy,
)
from mpgraph.policy.validate import PolicyDoc, check_choice, check_keys, check_number

__all__ = ["FP8_OPS", "parse_fp8"]

#: Op types the fp8 quantisation knows how to treat (their inputs 0 and 1 are the operands).
FP8_OPS = ("MatMul", "Gemm")
_KEYS = ("ops", "products", "forward", "backward", "scaling")
_SCALING_KEYS = tuple(f.name for f in dataclasses.fields(Fp8Scaling))
#: Longest amax history: a float32 vector per quantised tensor, kept in the step's state.
MAX_HISTORY = 1 << 16
#: Largest margin: 2**-64 of fp8_max is far below any useful scale.
MAX_MARGIN = 64


def parse_fp8(doc: PolicyDoc, data: dict[str, Any], base: Policy | None, dtype: ir.DataType) -> Fp8 | None:
    """``fp8``: the base's settings with this file's keys replaced, then checked.

    Args:
        doc: The parsed document (``fail`` names file, line and key path).
        data: The policy's top-level mapping.
        base: The policy ``extends`` names, if any.
        dtype: The policy's low dtype (fp8 needs one: float16 or bfloat16).
    """
    fp8 = base.fp8 if base else None
    if "fp8" not in data:
        return fp8
    section = data["fp8"]
    if section is False or section is None:
        return None
    check_keys(doc, ("fp8",), section, _KEYS)
    fp8 = fp8 or Fp8()
    if dtype == ir.DataType.FLOAT:
        doc.fail(("fp8",), "needs a low dtype for the other ops: set dtype to bfloat16 or float16 (or extends: bf16)")
    values: dict[str, Any] = {}
    if "ops" in section:
        ops = section["ops"]
        if not isinstance(ops, list) or not ops:
            doc.fail(("fp8", "ops"), f"invalid value {ops!r}; expected a non-empty list of {', '.join(FP8_OPS)}")
        values["ops"] = tuple(check_choice(doc, ("fp8", "ops", str(i)), op, FP8_OPS) for i, op in enumerate(ops))
    if "products" in section:
        values["products"] = check_choice(doc, ("fp8", "products"), section["products"], FP8_PRODUCTS)
    for key in ("forward", "backward"):
        if key in section:
            values[key] = FP8_FORMATS[check_choice(doc, ("fp8", key), section[key], tuple(FP8_FORMATS))]
    if "scaling" in section:
        values["scaling"] = _parse_scaling(doc, section["scaling"], fp8.scaling)
    return dataclasses.replace(fp8, **values)


def _parse_scaling(doc: PolicyDoc, section: Any, base: Fp8Scaling) -> Fp8Scaling:
    """``fp8.scaling``: the recipe and its settings."""
    kp = ("fp8", "scaling")
    check_keys(doc, kp, section, _SCALING_KEYS)
    values = dataclasses.asdict(base)
    choices = {"recipe": SCALING_RECIPES, "amax": AMAX_COMPUTE, "rounding": SCALE_ROUNDING}
    limits = {"history": (1, MAX_HISTORY), "margin": (0, MAX_MARGIN)}
    for key, value in section.items():
        if key in choices:
            values[key] = check_choice(doc, (*kp, key), value, choices[key])
            continue
        number = check_number(doc, (*kp, key), value, integer=True)
        low, high = limits[key]
        if not low <= number <= high:
            doc.fail((*kp, key), f"invalid value {number!r}; expected an integer from {low} to {high}")
        values[key] = int(number)
    return Fp8Scaling(**values)
