"""ORT's two ways of placing a step's intermediate buffers, replayed: the BFC arena and the
memory pattern (``estimate_memory`` walks the buffers; this module places them).

1. **The arena** (``arena_bytes``). ORT's ``BFCArena`` serves each request from the smallest
   free chunk that fits (rounded up to ``ARENA_UNIT``), split when the chunk is twice the
   request or more (or would leave ``ARENA_MAX_DEAD`` unused). When none fits it grows by a
   new region, and regions never merge, so the arena ends above the transient peak. How much
   it grows by is its ``arena_extend_strategy``:

   - ``kSameAsRequested``: exactly the request.
   - ``kNextPowerOfTwo`` (the CUDA provider's default): the current region size, which starts
     at ``ARENA_INITIAL_CHUNK``, doubles after every extension while it stays under
     ``ARENA_MAX_POWER_OF_TWO_EXTEND``, and is doubled up to any larger request first. A
     1.65 GB request (GPT-2's float32 logits) takes a 2 GiB region; the rest of a region serves
     later requests, so the growth is not all waste, but the last regions are mostly empty.

2. **The memory pattern** (``pattern_block``): ORT's ``MemPatternPlanner`` packs the first
   step's buffers into one block at fixed offsets, which later steps allocate at once.

Example: three buffers of 256 bytes, the second freed before the third is made; both
strategies reuse the freed chunk, the power-of-two arena's first 1 MiB region holds them all:

    >>> buffers = [Buffer("a", 0, 2, 256), Buffer("b", 0, 0, 256), Buffer("c", 1, 2, 256)]
    >>> arena_bytes(buffers), arena_bytes(buffers, POWER_OF_TWO) == ARENA_INITIAL_CHUNK
    (512, True)
"""

from __future__ import annotations

import dataclasses

__all__ = ["ARENA_STRATEGIES", "Buffer", "POWER_OF_TWO", "SAME_AS_REQUESTED", "arena_bytes", "pattern_block"]

#: ORT's allocation alignment (``kAllocAlignment``): the memory pattern rounds every buffer up to it.
PATTERN_ALIGNMENT = 64
#: ORT's BFC arena rounds every request up to this many bytes (``kMinAllocationSize``).
ARENA_UNIT = 256
#: The arena splits a free chunk when it is twice the request or more, or would leave this many
#: bytes unused (``max_dead_bytes_per_chunk``, 128 MiB by default).
ARENA_MAX_DEAD = 128 << 20
#: ``kNextPowerOfTwo``'s first region (``initial_chunk_size_bytes``, 1 MiB by default) and the
#: size past which it stops doubling (``max_power_of_two_extend_bytes``, 1 GiB by default).
ARENA_INITIAL_CHUNK = 1 << 20
ARENA_MAX_POWER_OF_TWO_EXTEND = 1 << 30
#: ``arena_extend_strategy`` by ORT's option value: 0 ``kNextPowerOfTwo``, 1 ``kSameAsRequested``.
POWER_OF_TWO, SAME_AS_REQUESTED = "kNextPowerOfTwo", "kSameAsRequested"
ARENA_STRATEGIES = (POWER_OF_TWO, SAME_AS_REQUESTED)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An intermediate buffer: made by node ``start``, last read by node ``end`` (walk positions)."""

    name: str
    start: int
    end: int
    nbytes: int


def _events(buffers: list[Buffer]) -> list[tuple[int, int, int]]:
    """(position, 0 = allocate / 1 = free, buffer index), in the order ORT sees them."""
    return sorted([(b.start, 0, k) for k, b in enumerate(buffers)] + [(b.end, 1, k) for k, b in enumerate(buffers)])


def pattern_block(buffers: list[Buffer], align: int = PATTERN_ALIGNMENT) -> int:
    """Size of ORT's memory-pattern block for these buffers.

    ORT's ``MemPatternPlanner`` replays the first step's allocations: each buffer takes the
    smallest gap between live blocks that fits it (rounded up to ``align`` bytes), or goes after
    the live block with the highest offset; the block is the highest end ever reached. Gaps
    left by freed buffers make it larger than the live peak.
    """
    blocks: list[tuple[int, int, int]] = []  # (offset, size, buffer) sorted by offset
    size = 0
    for _, kind, k in _events(buffers):
        if kind == 1:
            blocks = [blk for blk in blocks if blk[2] != k]
            continue
        need = -(-buffers[k].nbytes // align) * align
        best, best_offset, waste, current = len(blocks), (blocks[-1][0] + blocks[-1][1]) if blocks else 0, None, 0
        for j, (offset, nbytes, _) in enumerate(blocks):
            gap = offset - current
            if gap >= need and (waste is None or gap - need < waste):
                best, best_offset, waste = j, current, gap - need
            current = offset + nbytes
        size = max(size, best_offset + need)
        blocks.insert(best, (best_offset, need, k))
    return size


class _Growth:
    """How much the arena grows by when no free chunk fits a request (``strategy``)."""

    def __init__(self, strategy: str) -> None:
        if strategy not in ARENA_STRATEGIES:
            raise ValueError(f"arena strategy must be one of {', '.join(ARENA_STRATEGIES)}, not {strategy!r}")
        self.strategy, self.region = strategy, ARENA_INITIAL_CHUNK

    def extend(self, need: int) -> int:
        if self.strategy == SAME_AS_REQUESTED:
            return need
        increased = False
        while need > self.region:
            self.region *= 2
            increased = True
        size = self.region
        if not increased:
            self.region = min(self.region * 2, ARENA_MAX_POWER_OF_TWO_EXTEND)
        return size


def arena_bytes(buffers: list[Buffer], strategy: str = SAME_AS_REQUESTED) -> int:
    """Bytes ORT's BFC arena holds after the first step (see the module for the rules).

    A freed chunk merges with its free neighbours in its region, but regions never merge.
    """
    regions: list[list[list[int]]] = []  # per region, its chunks [offset, size, buffer or -1] by offset
    where: dict[int, tuple[int, list[int]]] = {}
    growth = _Growth(strategy)
    total = 0
    for _, kind, k in _events(buffers):
        if kind == 1:
            if k in where:
                _free_chunk(regions, *where.pop(k))
            continue
        need = -(-buffers[k].nbytes // ARENA_UNIT) * ARENA_UNIT
        if need == 0:
            continue
        fits = [(c[1], r, c[0], c) for r, chunks in enumerate(regions) for c in chunks if c[2] < 0 and c[1] >= need]
        if not fits:
            size = growth.extend(need)
            regions.append([[0, size, -1]])
            total += size
            fits = [(size, len(regions) - 1, 0, regions[-1][0])]
        _, r, _, chunk = min(fits, key=lambda f: f[:3])
        if chunk[1] >= 2 * need or chunk[1] - need >= ARENA_MAX_DEAD:
            chunks = regions[r]
            chunks.insert(next(i for i, c in enumerate(chunks) if c is chunk) + 1, [chunk[0] + need, chunk[1] - need, -1])
            chunk[1] = need
        chunk[2] = k
        where[k] = (r, chunk)
    return total


def _free_chunk(regions: list[list[list[int]]], region: int, chunk: list[int]) -> None:
    """Free ``chunk`` and merge it with the free chunks next to it in its region."""
    chunks = regions[region]
    chunk[2] = -1
    i = next(i for i, c in enumerate(chunks) if c is chunk)
    if i + 1 < len(chunks) and chunks[i + 1][2] < 0:
        chunk[1] += chunks.pop(i + 1)[1]
    if i > 0 and chunks[i - 1][2] < 0:
        chunks[i - 1][1] += chunks.pop(i)[1]
