"""Gradient rules, grouped by op family. Importing this package registers all of them."""

from mpgraph.autodiff.rules import (  # noqa: F401
    activation,
    elementwise,
    groupnorm,
    linalg,
    loss,
    nondiff,
    norm,
    pool_conv,
    reduce,
    shape,
)

__all__: list[str] = []
