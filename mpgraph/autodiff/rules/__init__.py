"""Gradient rules, grouped by op family. Importing this package registers all of them.

The RNN/GRU/LSTM rules live with their unrolling, in ``mpgraph/autodiff/lower_recurrent.py``.
"""

from mpgraph.autodiff import lower_recurrent  # noqa: F401  (its RNN/GRU/LSTM rules)
from mpgraph.autodiff.rules import (  # noqa: F401
    activation,
    attention,
    elementwise,
    groupnorm,
    linalg,
    loss,
    nondiff,
    norm,
    pool_conv,
    reduce,
    resize,
    shape,
)

__all__: list[str] = []
