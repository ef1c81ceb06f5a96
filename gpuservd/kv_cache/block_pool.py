"""Paged KV block bookkeeping: which blocks are free, who references them.

Mechanism only: the pool answers "can I allocate n blocks", hands out block
ids, and takes them back when their reference count drops to zero. Who waits
or gets preempted when it says no is the scheduler's decision.
Reference counts make a block shareable (prefix sharing, a swap in flight).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A fixed set of block ids [0, num_blocks) with reference counts."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.limit = num_blocks  # a memory quota (G3) may hold the pool below its size: see set_limit
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def capacity(self) -> int:
        """Blocks this pool may have in use: its size, or less under a memory quota."""
        return min(self.num_blocks, self.limit)

    def set_limit(self, num_blocks: int | None) -> None:
        """Cap the blocks in use (None = no cap). Blocks already in use above the cap stay until the
        scheduler moves its own requests out (it keeps usage under capacity); none are taken away here."""
        self.limit = self.num_blocks if num_blocks is None else max(1, min(int(num_blocks), self.num_blocks))

    @property
    def num_free(self) -> int:
        return max(0, min(len(self._free), self.capacity - self.num_used))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the capacity in use, 0..1 (above 1 right after a quota was lowered)."""
        return self.num_used / self.capacity

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with refcount 1, or None (and nothing taken) if too few are free."""
        if n > self.num_free:
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already in use (prefix sharing, in-flight copies)."""
        for b in block_ids:
            if self._refcount[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refcount[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        for b in block_ids:
            rc = self._refcount[b]
            if rc < 1:
                raise ValueError(f"block {b} freed twice")
            self._refcount[b] = rc - 1
            if rc == 1:
                self._free.append(b)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]
