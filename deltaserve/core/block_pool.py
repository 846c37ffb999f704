"""A pool of KV block ids with reference counts. Plain Python: ids only, no tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids [0, num_blocks) and takes them back when their last holder lets go."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with a reference count of 1; ValueError if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} are free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free queue."""
        for i in block_ids:
            if self._ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} released more often than it was taken")
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                self._free.append(i)
