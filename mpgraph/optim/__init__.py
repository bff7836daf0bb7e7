"""Optimizer steps built into the training graph: SGD (momentum, Nesterov), Adam, AdamW.

Semantics follow ``torch.optim`` (single-tensor implementation); state is fp32 and the
learning rate is a runtime graph input. ``flat=True`` updates every float32 parameter as one
flat buffer (state ``optim/flat/*``), the multi-tensor form of Apex and DeepSpeed: the same
numbers, a constant number of update nodes.
"""

from mpgraph.optim.adam import Adam, AdamW
from mpgraph.optim.base import OPTIMIZERS, Optimizer, StateFactory, make_optimizer
from mpgraph.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "StateFactory", "OPTIMIZERS", "make_optimizer"]
