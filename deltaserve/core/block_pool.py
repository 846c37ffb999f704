"""KV block ids with reference counts and, with prefix caching, a cache of full blocks by hash.

Plain Python: ids and hashes only. A block whose last holder lets go stays cached (its hash still
finds it) until it is reused for a new allocation; free blocks are reused in this order:
  1. blocks holding no cached prefix;
  2. cached blocks that no state checkpoint can serve (no checkpoint at or beyond them on their
     chain, so no joint KV+state hit can ever use them), least recently used first;
  3. cached blocks some checkpoint can serve, least recently used first.
Cached blocks form a tree by parent hash. Evicting a block makes every block below it unreachable:
their hashes are dropped at once and `on_drop` is told about each, so their checkpoints go too.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from deltaserve.core.block_hash import BlockHash


class BlockPool:
    """Hands out block ids [0, num_blocks)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_unservable: OrderedDict[int, None] = OrderedDict()
        self._free_servable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._serve_count: dict[BlockHash, int] = {}
        self.on_drop: Callable[[BlockHash], None] | None = None
        self.num_evicted_blocks = 0

    # Queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_unservable) + len(self._free_servable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # Allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks for new tokens, reference count 1, evicting cached blocks if needed."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        ids = []
        for _ in range(n):
            if self._free_plain:
                block = self._free_plain.popleft()
            elif self._free_unservable:
                block = self._free_unservable.popitem(last=False)[0]
            else:
                block = self._free_servable.popitem(last=False)[0]
            self._ref_counts[block] = 1  # before evicting: the hooks must not re-queue it
            if self._hash_of[block] is not None:
                self._evict(block)
            ids.append(block)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (a prefix hit), taking free ones out of the free queues."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                self._free_unservable.pop(block, None)
                self._free_servable.pop(block, None)
            self._ref_counts[block] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, in the given order (pass a table tail first)."""
        for block in block_ids:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._enqueue_free(block)

    def _enqueue_free(self, block: int) -> None:
        h = self._hash_of[block]
        if h is None:
            self._free_plain.append(block)
        elif self._serve_count.get(h, 0) > 0:
            self._free_servable[block] = None
        else:
            self._free_unservable[block] = None

    # The prefix cache ------------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: BlockHash, parent: BlockHash | None) -> bool:
        """File a full, computed block under its hash; False (nothing changed) if that hash is already
        cached in another block, or the block's parent is not cached (the chain would be unreachable)."""
        if block_hash in self._cached or self._hash_of[block_id] is not None:
            return False
        if parent is not None and parent not in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._parent[block_hash] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(block_hash)
        return True

    def add_servability(self, block_hash: BlockHash, delta: int) -> None:
        """A checkpoint at `block_hash` appeared (+1) or went (-1): update it and every ancestor."""
        h: BlockHash | None = block_hash
        while h is not None and h in self._cached:
            before = self._serve_count.get(h, 0)
            after = before + delta
            if after:
                self._serve_count[h] = after
            else:
                self._serve_count.pop(h, None)
            block = self._cached[h]
            if self._ref_counts[block] == 0 and (before > 0) != (after > 0):
                self._free_unservable.pop(block, None)
                self._free_servable.pop(block, None)
                self._enqueue_free(block)
            h = self._parent.get(h)

    def _evict(self, block: int) -> None:
        """Reuse a cached free block: drop its hash and the (unreachable) subtree below it."""
        root = self._hash_of[block]
        assert root is not None
        subtree, stack = [], [root]
        while stack:
            h = stack.pop()
            subtree.append(h)
            stack.extend(self._children.get(h, ()))
        if self.on_drop is not None:
            for h in subtree:  # checkpoints go first, while the chain to the root is intact
                self.on_drop(h)
        parent = self._parent.get(root)
        if parent is not None:
            self._children.get(parent, set()).discard(root)
        for h in subtree:
            b = self._cached.pop(h)
            self._hash_of[b] = None
            self._parent.pop(h, None)
            self._children.pop(h, None)
            self._serve_count.pop(h, None)
            if b != block and self._ref_counts[b] == 0:
                self._free_unservable.pop(b, None)
                self._free_servable.pop(b, None)
                self._free_plain.appendleft(b)
        self.num_evicted_blocks += len(subtree)
