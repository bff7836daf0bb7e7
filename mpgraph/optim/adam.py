"""Adam and AdamW with bias correction, as ``torch.optim.Adam`` / ``torch.optim.AdamW``."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import NODE_ON_SKIP
from mpgraph.optim.base import OPTIMIZERS, StateFactory, slots, unpack

__all__ = ["Adam", "AdamW"]


@dataclasses.dataclass(frozen=True)
class Adam:
    """``torch.optim.Adam`` (L2 weight decay folded into the gradient).

    Attributes:
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Denominator epsilon (added after the bias-corrected square root).
        weight_decay: L2 penalty (Adam) or decoupled decay (AdamW).
        amsgrad: Divide by the running maximum of the second moment (its own state,
            ``optim/<param>/v_max``), as ``torch.optim.Adam(amsgrad=True)``.
        pack: Update small parameters together as one flat vector (see ``optim.base.pack``).
        flat: Update every float32 parameter together as one flat vector, state
            ``optim/flat/<state>`` (see ``optim.base.slots``): a constant number of update
            nodes whatever the parameter count. Same math, so the same numbers as per-tensor.
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    pack: bool = True
    flat: bool = False
    decoupled = False

    def build(
        self, b: Builder, params: list[tuple[ir.Value, ir.Value]], lr: ir.Value,
        state: StateFactory,
    ) -> tuple[dict[str, ir.Value], list[tuple[ir.Value, ir.Value]]]:
        """Emit the update (see ``Optimizer.build``)."""
        step = state("optim/step", None, 0.0)
        coefficients = _Coefficients(b)
        # The counter itself is selected back on a skipped step ("old"): the bias corrections
        # below must see t >= 1 (at t = 0 they divide by zero).
        t = _gate(b.op("Add", step, b.scalar(1.0, step)), on_skip="old")
        pairs = [(step, t)]
        # Bias corrections in float64, as torch computes them on Python floats.
        t64 = b.op("Cast", t, to=ir.DataType.DOUBLE)
        one = b.scalar(1.0, t64)
        bc1 = b.op("Sub", one, b.op("Pow", b.scalar(self.beta1, t64), t64))
        bc2 = b.op("Sub", one, b.op("Pow", b.scalar(self.beta2, t64), t64))
        lr64 = b.op("Cast", lr, to=ir.DataType.DOUBLE)
        step_size = _gate(b.op("Cast", b.op("Div", lr64, bc1), to=ir.DataType.FLOAT), on_skip=0)
        bc2_sqrt = b.op("Cast", b.op("Sqrt", bc2), to=ir.DataType.FLOAT)
        decay = None
        if self.decoupled and self.weight_decay:
            decay = _gate(b.op("Sub", b.scalar(1.0, lr), b.op("Mul", lr, b.scalar(self.weight_decay, lr))), on_skip=1)
        updated: dict[str, ir.Value] = {}
        for slot in slots(b, params, pack_small=self.pack, flat=self.flat):
            p, g = slot.param, slot.grad
            if self.weight_decay and not self.decoupled:
                g = b.op("Add", g, b.op("Mul", p, b.scalar(self.weight_decay, p)))
            p_decayed = b.op("Mul", p, decay) if decay is not None else p
            m = state(f"optim/{slot.name}/m", p, 0.0)
            v = state(f"optim/{slot.name}/v", p, 0.0)
            c1 = coefficients.get("beta1_complement", 1 - self.beta1, p, on_skip=0)
            b2 = coefficients.get("beta2", self.beta2, p, on_skip=1)
            c2 = coefficients.get("beta2_complement", 1 - self.beta2, p, on_skip=0)
            m_new = b.op("Add", m, b.op("Mul", b.op("Sub", g, m), c1))
            v_new = b.op("Add", b.op("Mul", v, b2), b.op("Mul", b.op("Mul", g, g), c2))
            second = v_new
            if self.amsgrad:
                v_max = state(f"optim/{slot.name}/v_max", p, 0.0)
                second = b.op("Max", v_max, v_new)
                pairs.append((v_max, second))
            denom = b.op("Add", b.op("Div", b.op("Sqrt", second), bc2_sqrt), b.scalar(self.eps, p))
            update = b.op("Mul", b.op("Div", m_new, denom), step_size)
            updated.update(unpack(b, slot, b.op("Sub", p_decayed, update)))
            pairs += [(m, m_new), (v, v_new)]
        return updated, pairs


class _Coefficients:
    """Scalar ``Constant`` nodes ``optim/<name>`` (one per name and dtype) that loss scaling
    may gate; the other constants stay shared initializers."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        self.made: dict[tuple[str, ir.DataType], ir.Value] = {}

    def get(self, name: str, value: float, like: ir.Value, *, on_skip: int | str) -> ir.Value:
        dtype = like.dtype or ir.DataType.FLOAT
        key = (name, dtype)
        if key not in self.made:
            array = np.array(value, dtype=dtype.numpy())
            self.made[key] = _gate(self.b.op("Constant", name=name, value=ir.tensor(array)), on_skip=on_skip)
        return self.made[key]


def _gate(value: ir.Value, *, on_skip: int | str) -> ir.Value:
    """Mark ``value``'s producer with what it becomes on a skipped step (``NODE_ON_SKIP``):
    ``0`` or ``1``, or ``old`` for a state update that is selected back (the step counter).

    With every coefficient below gated, a skipped step computes exactly the old state from a
    zeroed gradient: ``m + (g - m) * 0``, ``v * 1 + g * g * 0`` and ``p * 1 - u * 0``. Loss
    scaling then selects only the scalar step counter.
    """
    producer = value.producer()
    assert producer is not None
    producer.metadata_props[NODE_ON_SKIP] = str(on_skip)
    return value


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """``torch.optim.AdamW``: decoupled weight decay ``p *= 1 - lr * weight_decay`` first."""

    weight_decay: float = 1e-2
    decoupled = True


OPTIMIZERS["adam"] = Adam
OPTIMIZERS["adamw"] = AdamW
