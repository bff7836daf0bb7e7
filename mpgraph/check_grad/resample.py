"""AveragePool and Resize along one axis as a matrix, and Erf as a series, in float64.

ORT's CPU provider has no float64 kernel for ``AveragePool``, ``Resize`` or ``Erf``. With
static shapes, pooling and resizing (``linear`` and ``nearest``) are linear maps that act on
each spatial axis separately, so ``float64`` computes them as ``P_h @ x @ P_w^T`` with the
matrices built here (ORT's index and divisor rules, coordinates in float64).

Example:
    >>> pool_matrix(4, kernel=2, stride=2, pads=(0, 0), ceil_mode=False, count_include_pad=False)
    array([[0.5, 0.5, 0. , 0. ],
           [0. , 0. , 0.5, 0.5]])
    >>> resize_matrix(2, 4, scale=2.0, mode="linear", transform="half_pixel", nearest="floor")[:, 0]
    array([1.  , 0.75, 0.25, 0.  ])
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ERF_CLIP", "ERF_SCALE", "erf_series", "pool_matrix", "resize_matrix"]

#: ``|x|`` beyond which ``erf(x)`` is ``±1`` in float64 (``erfc(6) = 2e-17``).
ERF_CLIP = 6.0
#: ``2 / sqrt(pi)``, the series' leading factor.
ERF_SCALE = 2.0 / math.sqrt(math.pi)
_ERF_TERMS = 100
#: ``RESIZE_TRANSFORMS[mode](x_out, scale, in_len, out_len)``: the input coordinate of an
#: output index (ONNX Resize ``coordinate_transformation_mode``).
RESIZE_TRANSFORMS = {
    "half_pixel": lambda x, s, n_in, n_out: (x + 0.5) / s - 0.5,
    "pytorch_half_pixel": lambda x, s, n_in, n_out: (x + 0.5) / s - 0.5 if n_out > 1 else 0.0 * x,
    "align_corners": lambda x, s, n_in, n_out: x * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0 * x,
    "asymmetric": lambda x, s, n_in, n_out: x / s,
}
_NEAREST = {
    "round_prefer_floor": lambda c: np.where(c - np.floor(c) == 0.5, np.floor(c), np.round(c)),
    "round_prefer_ceil": lambda c: np.where(c - np.floor(c) == 0.5, np.ceil(c), np.round(c)),
    "floor": np.floor,
    "ceil": np.ceil,
}


def pool_output_len(size: int, kernel: int, stride: int, pads: tuple[int, int], ceil_mode: bool) -> int:
    """ONNX pooling output length; with ``ceil_mode`` the last window must start inside the
    input or its head padding."""
    span = size + pads[0] + pads[1] - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pads[0]:
        out -= 1
    return out


def pool_matrix(size: int, kernel: int, stride: int, pads: tuple[int, int], ceil_mode: bool,
                count_include_pad: bool) -> np.ndarray:
    """``[out, size]``: AveragePool along one axis (ORT's divisor: the window clipped to the
    padded input with ``count_include_pad``, else to the input). Divisors multiply across axes."""
    out = pool_output_len(size, kernel, stride, pads, ceil_mode)
    matrix = np.zeros((out, size))
    for o in range(out):
        start = o * stride - pads[0]
        end = min(start + kernel, size + pads[1])
        lo, hi = max(start, 0), min(end, size)
        matrix[o, lo:hi] = 1.0 / ((end - start) if count_include_pad else (hi - lo))
    return matrix


def resize_matrix(size: int, out: int, scale: float, mode: str, transform: str, nearest: str) -> np.ndarray | None:
    """``[out, size]``: Resize along one axis (``mode`` linear or nearest), or ``None`` for a
    mode or transform not handled here."""
    coord = RESIZE_TRANSFORMS.get(transform)
    if coord is None or mode not in ("linear", "nearest") or (mode == "nearest" and nearest not in _NEAREST):
        return None
    x = coord(np.arange(out, dtype=np.float64), scale, size, out)
    matrix = np.zeros((out, size))
    rows = np.arange(out)
    if mode == "nearest":
        matrix[rows, np.clip(_NEAREST[nearest](x), 0, size - 1).astype(np.int64)] = 1.0
        return matrix
    x = np.clip(x, 0, size - 1)
    low = np.floor(x).astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    np.add.at(matrix, (rows, low), 1.0 - (x - low))
    np.add.at(matrix, (rows, high), x - low)
    return matrix


def erf_series() -> np.ndarray:
    """Ratios ``r_n = 2 / (2n+1)``, ``n >= 1``, of the terms of
    ``erf(x) = ERF_SCALE * x * exp(-x**2) * (1 + r_1 t (1 + r_2 t (1 + ...)))``, ``t = x**2``:
    every term positive (no cancellation). A Horner chain on the coefficients
    ``2**n / (2n+1)!!`` themselves (down to 1e-157) lost its high terms under ORT's default
    optimizations (not without them); these ratios lie in [0.01, 0.67]. 100 terms reach 2e-15
    for ``|x| <= ERF_CLIP``."""
    n = np.arange(1, _ERF_TERMS, dtype=np.float64)
    return 2.0 / (2 * n + 1)
