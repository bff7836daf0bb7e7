"""Central finite differences along a direction, the arithmetic both checks share."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["central", "direction"]


def central(f: Callable[[float], float], analytic: float, h: float, noise: float) -> tuple[float, float]:
    """Central difference ``(f(h) - f(-h)) / 2h`` and its relative error against ``analytic``;
    differences below the rounding ``noise`` of ``f`` count as agreement.

    Example:
        >>> numeric, rel = central(lambda t: (1.0 + t) ** 2, 2.0, 1e-3, 1e-16)
        >>> round(numeric, 9), rel < 1e-9
        (2.0, True)
    """
    numeric = (f(h) - f(-h)) / (2 * h)
    return numeric, abs(analytic - numeric) / max(abs(analytic), abs(numeric), noise / h)


def direction(g: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vector: a random one plus the normalized gradient, so ``|<g, d>|`` is of the order
    of ``|g|`` even for a million-element tensor and the finite difference resolves it."""
    r = rng.standard_normal(g.shape)
    r /= max(float(np.linalg.norm(r)), 1e-300)
    norm = float(np.linalg.norm(g))
    d = r + (g / norm if norm > 0 and np.isfinite(norm) else 0.0)
    return d / max(float(np.linalg.norm(d)), 1e-300)
