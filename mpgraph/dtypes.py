"""Float dtype facts: widths, ranges, and which casts lose nothing.

Whether a cast pair folds is decided from exponent and mantissa widths, never from enum
numbers: ``Cast(a->b)`` then ``Cast(b->c)`` equals ``Cast(a->c)`` when ``a->b`` is lossless,
i.e. ``b`` has at least ``a``'s exponent bits and mantissa bits and the same special values.

Example:
    >>> import onnx_ir as ir
    >>> is_lossless(ir.DataType.FLOAT16, ir.DataType.FLOAT)
    True
    >>> is_lossless(ir.DataType.FLOAT, ir.DataType.FLOAT16)
    False
    >>> is_lossless(ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    False
    >>> is_lossless(ir.DataType.FLOAT8E5M2FNUZ, ir.DataType.FLOAT16)
    True
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import onnx_ir as ir

__all__ = [
    "FLOAT_TYPES",
    "FloatFormat",
    "FLOAT_FORMATS",
    "is_float",
    "is_lossless",
    "short_name",
    "numpy_dtype",
    "finite_max",
    "smallest_subnormal",
    "float_weight_bytes",
]


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """Bit layout of a float format.

    Attributes:
        exponent: Exponent bits.
        mantissa: Explicit mantissa (fraction) bits.
        has_inf: Whether +-inf are representable.
        has_nan: Whether NaN is representable.
        has_negative_zero: Whether -0.0 is distinct (false for the FNUZ formats).
        bias_shift: Exponent-bias offset from the IEEE default (1 for the FNUZ formats).
    """

    exponent: int
    mantissa: int
    has_inf: bool = True
    has_nan: bool = True
    has_negative_zero: bool = True
    bias_shift: int = 0


FLOAT_FORMATS: dict[ir.DataType, FloatFormat] = {
    ir.DataType.DOUBLE: FloatFormat(11, 52),
    ir.DataType.FLOAT: FloatFormat(8, 23),
    ir.DataType.FLOAT16: FloatFormat(5, 10),
    ir.DataType.BFLOAT16: FloatFormat(8, 7),
    ir.DataType.FLOAT8E4M3FN: FloatFormat(4, 3, has_inf=False),
    ir.DataType.FLOAT8E4M3FNUZ: FloatFormat(4, 3, has_inf=False, has_negative_zero=False, bias_shift=1),
    ir.DataType.FLOAT8E5M2: FloatFormat(5, 2),
    ir.DataType.FLOAT8E5M2FNUZ: FloatFormat(5, 2, has_inf=False, has_negative_zero=False, bias_shift=1),
}

#: The float dtypes that compute: values of these types are differentiated, are parameters,
#: and are what a precision policy lowers or keeps. (The fp8 formats are storage only; cast
#: folding knows them through ``FLOAT_FORMATS``.)
FLOAT_TYPES = frozenset({ir.DataType.DOUBLE, ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})

_SHORT = {
    ir.DataType.DOUBLE: "fp64",
    ir.DataType.FLOAT: "fp32",
    ir.DataType.FLOAT16: "fp16",
    ir.DataType.BFLOAT16: "bf16",
}


def is_float(dtype: ir.DataType | None) -> bool:
    """True for the float formats mpgraph reasons about (fp64 down to fp8)."""
    return dtype in FLOAT_FORMATS


def is_lossless(src: ir.DataType, dst: ir.DataType) -> bool:
    """Whether every value of ``src`` survives a cast to ``dst`` exactly.

    True when ``dst`` has at least as many exponent and mantissa bits, can represent every
    special value of ``src`` (inf, NaN, -0) and has an exponent range covering ``src``'s.
    """
    if src == dst:
        return True
    a, b = FLOAT_FORMATS.get(src), FLOAT_FORMATS.get(dst)
    if a is None or b is None:
        return False
    if a.has_inf and not b.has_inf:
        return False
    if a.has_nan and not b.has_nan:
        return False
    if a.has_negative_zero and not b.has_negative_zero:
        return False
    # Exponent range: max exponent 2**(e-1) - 1 - shift, min normal exponent 2 - 2**(e-1) - shift.
    a_max, b_max = 2 ** (a.exponent - 1) - 1 - a.bias_shift, 2 ** (b.exponent - 1) - 1 - b.bias_shift
    a_min_sub = 2 - 2 ** (a.exponent - 1) - a.bias_shift - a.mantissa
    b_min_sub = 2 - 2 ** (b.exponent - 1) - b.bias_shift - b.mantissa
    # Formats without inf use the all-ones exponent for finite values.
    if not a.has_inf:
        a_max += 1
    if not b.has_inf:
        b_max += 1
    # Every src value is a multiple of 2**a_min_sub below 2**(a_max + 1). dst spaces its values
    # 2**(e - b.mantissa) apart at binary exponent e, never finer than 2**b_min_sub; so a src value
    # at exponent e (spacing 2**(e - a.mantissa) >= 2**a_min_sub) survives when b.mantissa >=
    # a.mantissa and b_min_sub <= a_min_sub, even where it is a dst subnormal (fp8 e5m2fnuz's
    # smallest normal, 2**-15, is an fp16 subnormal and exact).
    return b.mantissa >= a.mantissa and b_max >= a_max and b_min_sub <= a_min_sub


def short_name(dtype: ir.DataType) -> str:
    """``fp32``, ``fp16``, ``bf16``... used in generated names."""
    return _SHORT.get(dtype, dtype.name.lower())


def numpy_dtype(dtype: ir.DataType) -> np.dtype:
    """The numpy (or ml_dtypes) dtype of an ONNX float type."""
    return dtype.numpy()


def finite_max(dtype: ir.DataType) -> float:
    """Largest finite value of a float dtype."""
    return float(ml_dtypes.finfo(numpy_dtype(dtype)).max)


def smallest_subnormal(dtype: ir.DataType) -> float:
    """Smallest positive value of a float dtype; nonzeros below half of it flush to zero."""
    return float(ml_dtypes.finfo(numpy_dtype(dtype)).smallest_subnormal)


def float_weight_bytes(model: ir.Model) -> int:
    """Bytes held by the float initializers (weights) of ``model``'s main graph."""
    return sum(
        v.const_value.nbytes
        for v in model.graph.initializers.values()
        if v.const_value is not None and is_float(v.dtype)
    )
