"""Bytes each rank of a data-parallel run holds for its state, gradients and reduction.

``rank_memory`` reads a step graph the way ``runtime.data_parallel.DataParallelRunner`` lays
it out (``training.split_step_graph``), without running it:

1. **Master weights**: every parameter on every rank (the forward of each rank reads them).
2. **Optimizer state**: all of it on every rank; with ``shard_optimizer`` (ZeRO-1) each
   rank's slice of every packed slot's moments (``training.flat_slots``), its share of the
   other update groups (``training.optimizer_groups``, dealt by ``training.deal_groups``),
   as the runner splits them, plus the scalars every rank keeps.
   Example: per-tensor AdamW on the zoo GPT over 2 ranks: the moments split 50/50 up to the
   largest group.
3. **State outputs**: a second buffer for every state value a rank holds (the step writes
   the new state beside the old).
4. **Gradient buckets**: every gradient in float32, and the loss.
5. **Receive buffers**: ``reduction="ordered"`` receives one chunk of every rank's bucket
   (the buckets' size again, less their padding to a multiple of the world size);
   ``all_reduce`` reduces in place (none).

Activations are not here: a rank's are those of one process at the per-rank batch
(``estimate_memory`` with ``batch / world``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mpgraph.training.shard_flat_slot import flat_slots, slice_range
from mpgraph.training.split_step_graph import deal_groups, optimizer_groups, split_step_graph

__all__ = ["RankBytes", "rank_memory"]


@dataclasses.dataclass(frozen=True)
class RankBytes:
    """What one rank holds, in bytes (the module's items 1-5)."""

    rank: int
    master_weights: int
    optimizer_state: int
    state_outputs: int
    gradient_buckets: int
    receive_buffers: int

    @property
    def total(self) -> int:
        return (self.master_weights + self.optimizer_state + self.state_outputs + self.gradient_buckets
                + self.receive_buffers)


def rank_memory(step: ir.Model, world: int, *, shard_optimizer: bool = False,
                reduction: str = "ordered") -> list[RankBytes]:
    """The bytes of every rank of a ``world``-rank run of ``step`` (the module's rules).

    Raises:
        MpgraphError: ``step`` cannot be split (``split_step_graph``).
    """
    split = split_step_graph(step)
    inits = step.graph.initializers
    nbytes = {a: _bytes(inits[a]) if a in inits else 0 for a, _ in split.state_pairs}
    params = {p for p, _ in split.gradients}
    owner: dict[str, int] = {}
    slot_size: dict[str, int] = {}
    if shard_optimizer:
        slot_size = {n: slot.size for slot in flat_slots(split.apply, list(split.state_pairs), params) for n in slot.state}
        groups = [g for g in optimizer_groups(split)[0] if not any(n in slot_size for n in g)]
        dealt = deal_groups([sum(nbytes[n] for n in g) for g in groups], world)
        owner = {n: r for g, r in zip(groups, dealt, strict=True) for n in g}
    master = sum(nbytes[p] for p in params)
    buckets = 4 * (sum(nbytes[p] // max(_itemsize(inits[p]), 1) for p in params if p in inits) + 1)
    receive = buckets if reduction == "ordered" and world > 1 else 0
    out = []
    for rank in range(world):
        optimizer = sum(b for n, b in nbytes.items() if n not in params and n not in slot_size and owner.get(n, rank) == rank)
        optimizer += sum(nbytes[n] // size * _length(slice_range(size, rank, world)) for n, size in slot_size.items())
        out.append(RankBytes(rank, master, optimizer, master + optimizer, buckets, receive))
    return out


def _length(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _bytes(value: ir.Value) -> int:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return 0
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) * _itemsize(value)


def _itemsize(value: ir.Value) -> int:
    return int(value.dtype.itemsize) if value.dtype is not None else 4
