"""Flat float32 gradient buckets and the fixed-tree sum of a data-parallel step.

``make_buckets`` lays the gradients of a split step graph out in flat arrays (reverse
gradient order, a new bucket past ``bucket_bytes``, the loss last, each padded to a multiple
of the world size); ``pairwise_sum`` adds sequences of bucket sets as one fixed binary tree,
so a sum over slices and ranks has the same float32 bits however the slices are spread.
``reduce_buckets`` reduces a rank's buckets across a ``torch.distributed`` group.
``runtime.parallel_executor`` uses them.

Example:
    >>> terms = [[np.array([x], np.float32)] for x in (1.0, 2.0, 3.0)]
    >>> pairwise_sum(terms, lambda _: None)[0].tolist()  # (1 + 2) + 3
    [6.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mpgraph.training.split_step_graph import SplitStep

__all__ = ["Bucket", "make_buckets", "pairwise_sum", "reduce_buckets"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat float32 array and where each gradient (and maybe the loss) sits in it."""

    array: np.ndarray
    slots: tuple[tuple[str, int, tuple[int, ...]], ...]

    def views(self, array: Any = None) -> dict[str, Any]:
        """Each slot's view of ``array`` (a numpy array or torch tensor of the bucket's size;
        ``None``: the layout's own array)."""
        base = self.array if array is None else array
        return {name: base[start:start + int(np.prod(shape, dtype=np.int64))].reshape(shape)
                for name, start, shape in self.slots}


def make_buckets(split: SplitStep, shapes: Mapping[str, tuple[int, ...]], bucket_bytes: int,
                  world: int) -> list[Bucket]:
    """Gradients in reverse ``mpgraph.gradients`` order, a new bucket past ``bucket_bytes``;
    the loss last. Each array is padded with zeros to a multiple of ``world`` (equal chunks)."""
    layout: list[list[tuple[str, int, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in [*((g, shapes[g]) for _, g in reversed(split.gradients)), (split.loss, ())]:
        size = int(np.prod(shape, dtype=np.int64))
        if layout[-1] and (used + size) * 4 > bucket_bytes and name != split.loss:
            layout.append([])
            used = 0
        layout[-1].append((name, used, shape))
        used += size
    sizes = [sum(int(np.prod(s, dtype=np.int64)) for _, _, s in slots) for slots in layout]
    return [Bucket(np.zeros(-(-size // world) * world, np.float32), tuple(slots))
            for size, slots in zip(sizes, layout, strict=True)]


def pairwise_sum(terms: Iterable[list[np.ndarray]], release: Callable[[list[np.ndarray]], None]) -> list[np.ndarray]:
    """The sum of a sequence of bucket sets as a fixed binary tree, in place in the terms.

    Terms are merged like a binary counter: ``((t0 + t1) + (t2 + t3)) + ...``, and what is
    left at the end from the right: for 3 terms ``(t0 + t1) + t2``, for 6
    ``((t0 + t1) + (t2 + t3)) + (t4 + t5)``. A block of 2^k terms is one subtree wherever it
    starts at a multiple of 2^k, so ranks that each sum 2^k slices (``micro_batches``) and
    then sum across ranks the same way compute the very tree of one process over all the
    slices: the same float32 bits for any world size. ``release`` gets each set merged into
    another (free for reuse).
    """
    stack: list[tuple[int, list[np.ndarray]]] = []
    for arrays in terms:
        level = 0
        while stack and stack[-1][0] == level:
            _, left = stack.pop()
            _add_into(left, arrays)
            release(arrays)
            arrays, level = left, level + 1
        stack.append((level, arrays))
    _, total = stack.pop()
    while stack:
        _, left = stack.pop()
        _add_into(left, total)
        release(total)
        total = left
    return total


def _add_into(left: list[Any], right: list[Any]) -> None:
    """``left[i] += right[i]`` in place: numpy arrays or torch tensors (on any device)."""
    for a, b in zip(left, right, strict=True):
        a += b


def reduce_buckets(tensors: Sequence[Any], received: Sequence[Any], dist: Any, group: Any, ordered: bool) -> None:
    """Sum every rank's buckets into every rank's buckets, in place (every collective issued
    before the first wait).

    ``tensors`` are the buckets as torch tensors (over the bucket arrays on CPU; on a GPU the
    tensors that own the device memory ORT writes through DLPack), so the collectives read and
    write the buckets themselves, no copies. ``ordered``: per bucket an ``all_to_all`` (rank r
    receives chunk r of every rank's bucket into ``received``, tensors of the buckets' sizes
    on the same device), the fixed-tree sum of those chunks (torch adds, on their device), and
    an ``all_gather`` of the summed chunks back into every rank's bucket. Otherwise one
    ``all_reduce(SUM)`` a bucket (the backend's order). ``dist`` is ``torch.distributed``.
    """
    if not ordered:
        works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        return
    world = dist.get_world_size(group)
    scatters = [dist.all_to_all_single(r, t, group=group, async_op=True)
                for t, r in zip(tensors, received, strict=True)]
    gathers = []
    for tensor, r, work in zip(tensors, received, scatters, strict=True):
        work.wait()
        (total,) = pairwise_sum(([chunk] for chunk in r.view(world, -1).unbind(0)), lambda _: None)
        gathers.append(dist.all_gather(list(tensor.view(world, -1).unbind(0)), total, group=group, async_op=True))
    for work in gathers:
        work.wait()
