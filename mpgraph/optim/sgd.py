"""SGD with momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph.optim.base import OPTIMIZERS, StateFactory, slots, unpack

__all__ = ["SGD"]


@dataclasses.dataclass(frozen=True)
class SGD:
    """``torch.optim.SGD``: ``buf = m*buf + (1-dampening)*g`` (``buf = g`` on step 1).

    Attributes:
        momentum: Momentum factor (0 disables the buffer).
        dampening: Dampening of the momentum update.
        nesterov: Nesterov momentum.
        weight_decay: L2 penalty added to the gradient.
        pack: Update small parameters together as one flat vector (see ``optim.base.pack``).
        flat: Update every float32 parameter together as one flat vector, state
            ``optim/flat/<state>`` (see ``optim.base.slots``): a constant number of update
            nodes whatever the parameter count. Same math, so the same numbers as per-tensor.
    """

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    pack: bool = True
    flat: bool = False

    def build(
        self, b: Builder, params: list[tuple[ir.Value, ir.Value]], lr: ir.Value,
        state: StateFactory,
    ) -> tuple[dict[str, ir.Value], list[tuple[ir.Value, ir.Value]]]:
        """Emit the update (see ``Optimizer.build``)."""
        pairs: list[tuple[ir.Value, ir.Value]] = []
        first = None
        if self.momentum and self.dampening:  # torch starts the buffer at g, undamped
            step = state("optim/step", None, 0.0)
            pairs.append((step, b.op("Add", step, b.scalar(1.0, step))))
            first = b.op("Equal", step, b.scalar(0.0, step))
        updated: dict[str, ir.Value] = {}
        for slot in slots(b, params, pack_small=self.pack, flat=self.flat):
            p, g = slot.param, slot.grad
            if self.weight_decay:
                g = b.op("Add", g, b.op("Mul", p, b.scalar(self.weight_decay, p)))
            if self.momentum:
                buf = state(f"optim/{slot.name}/momentum", p, 0.0)
                new = b.op("Add", b.op("Mul", buf, b.scalar(self.momentum, p)),
                             g if not self.dampening else b.op("Mul", g, b.scalar(1 - self.dampening, p)))
                if first is not None:
                    new = b.op("Where", first, g, new)
                pairs.append((buf, new))
                g = b.op("Add", g, b.op("Mul", new, b.scalar(self.momentum, p))) if self.nesterov else new
            updated.update(unpack(b, slot, b.op("Sub", p, b.op("Mul", g, lr))))
        return updated, pairs


OPTIMIZERS["sgd"] = SGD
