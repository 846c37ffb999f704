"""KV block ids with reference counts and, with prefix caching, a cache of full blocks by hash.

Plain Python: ids and hashes only. A block whose last holder lets go stays cached (its hash still
finds it) until it is reused for a new allocation; free blocks are reused in this order:
  1. blocks holding no cached prefix;
  2. cached blocks that no state checkpoint can serve (no checkpoint at or beyond them on their
     chain, so no joint KV+state hit can ever use them), least recently used first;
  3. cached blocks some checkpoint can serve, least recently used first.
Cached blocks form a tree by parent hash. Evicting a block makes every block below it unreachable:
their hashes are dropped at once and `on_drop` is told about each, so their checkpoints go too.

Two requests that compute the same prefix at the same time hold two blocks of one hash: the first
committed is the cached one, the second is registered as its duplicate. When the cached block is
reused while a duplicate is still held, the duplicate takes its place, so the hash (and the tree
and checkpoints below it) survive; a duplicate nobody holds is simply freed.

Servability counts, per hash, the visible checkpoints at or below it. Each checkpoint's +1 is
recorded with the hashes it reached, and its -1 undoes exactly those, so no count can go negative
whatever was cached in between.
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
        self._counted: dict[BlockHash, list[BlockHash]] = {}  # checkpoint hash -> hashes its +1 reached
        self._duplicates: dict[BlockHash, list[int]] = {}  # cached hash -> other blocks holding the same KV
        self._duplicate_of: dict[int, BlockHash] = {}
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
                self._forget_duplicate(block)
                self._enqueue_free(block)

    def _forget_duplicate(self, block: int) -> None:
        h = self._duplicate_of.pop(block, None)
        if h is not None:
            self._duplicates[h].remove(block)
            if not self._duplicates[h]:
                del self._duplicates[h]

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
        """File a full, computed block under its hash; False if the block's parent is not cached (the
        chain would be unreachable) or it is filed already. A hash cached in another block makes this
        block that one's duplicate (True)."""
        filed = self._hash_of[block_id] or self._duplicate_of.get(block_id)
        if filed is not None:
            return filed == block_hash
        if parent is not None and parent not in self._cached:
            return False
        if block_hash in self._cached:  # held by another block: this one is its duplicate while held
            if self._ref_counts[block_id] == 0:
                return False
            self._duplicates.setdefault(block_hash, []).append(block_id)
            self._duplicate_of[block_id] = block_hash
            return True
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._parent[block_hash] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(block_hash)
        return True

    def add_servability(self, block_hash: BlockHash, delta: int) -> None:
        """A checkpoint at `block_hash` appeared (+1: it and every cached ancestor) or went (-1: the
        hashes its +1 reached)."""
        if delta > 0:
            reached = []
            h: BlockHash | None = block_hash
            while h is not None and h in self._cached:
                reached.append(h)
                h = self._parent.get(h)
            self._counted[block_hash] = reached
        else:
            reached = self._counted.pop(block_hash, [])
        for h in reached:
            if h not in self._cached:
                continue
            before = self._serve_count.get(h, 0)
            after = before + (1 if delta > 0 else -1)
            if after:
                self._serve_count[h] = after
            else:
                self._serve_count.pop(h, None)
            block = self._cached[h]
            if self._ref_counts[block] == 0 and (before > 0) != (after > 0):
                self._free_unservable.pop(block, None)
                self._free_servable.pop(block, None)
                self._enqueue_free(block)

    def _evict(self, block: int) -> None:
        """Reuse a cached free block: hand its hash to a duplicate still held, else drop the hash and
        the (unreachable) subtree below it."""
        root = self._hash_of[block]
        assert root is not None
        if self._duplicates.get(root):
            heir = self._duplicates[root].pop(0)
            if not self._duplicates[root]:
                del self._duplicates[root]
            del self._duplicate_of[heir]
            self._cached[root] = heir
            self._hash_of[heir] = root
            self._hash_of[block] = None
            return
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
            for dup in self._duplicates.pop(h, []):  # held by running requests; no longer findable
                del self._duplicate_of[dup]
            if b != block and self._ref_counts[b] == 0:
                self._free_unservable.pop(b, None)
                self._free_servable.pop(b, None)
                self._free_plain.appendleft(b)
        self.num_evicted_blocks += len(subtree)

    # Invariants ------------------------------------------------------------------------------
    def check_invariants(self, held: dict[int, int]) -> None:
        """Raise AssertionError unless every block is accounted for. `held`: block id -> how many
        block tables hold it (the KV cache manager's view)."""
        free = [*self._free_plain, *self._free_unservable, *self._free_servable]
        free_set = set(free)
        assert len(free) == len(free_set), "a block is queued free twice"
        for block in range(self.num_blocks):
            refs = self._ref_counts[block]
            assert refs == held.get(block, 0), f"block {block}: ref count {refs}, held by {held.get(block, 0)} tables"
            assert (refs == 0) == (block in free_set), f"block {block} (ref count {refs}) is queued free: not so"
        for block in free:
            assert self._ref_counts[block] == 0, f"free block {block} has references"
            h = self._hash_of[block]
            if h is None:
                assert block not in self._free_unservable and block not in self._free_servable, block
            else:
                servable = self._serve_count.get(h, 0) > 0
                assert (block in self._free_servable) == servable, f"free block {block} in the wrong queue"
        for h, block in self._cached.items():
            assert self._hash_of[block] == h, f"hash/block maps disagree at block {block}"
            parent = self._parent.get(h)
            assert parent is None or parent in self._cached, f"cached block {block} has an uncached parent"
            assert parent is None or h in self._children.get(parent, ()), f"block {block} missing from its parent"
        assert sum(1 for h in self._hash_of if h is not None) == len(self._cached), "stale block hashes"
        for h, dups in self._duplicates.items():
            assert h in self._cached and dups, "a duplicate of an uncached hash"
            for dup in dups:
                assert self._duplicate_of[dup] == h and self._ref_counts[dup] > 0, f"duplicate block {dup}"
        assert len(self._duplicate_of) == sum(len(d) for d in self._duplicates.values())
        expected: dict[BlockHash, int] = {}
        for reached in self._counted.values():
            for h in reached:
                if h in self._cached:
                    expected[h] = expected.get(h, 0) + 1
        assert all(count > 0 for count in self._serve_count.values()), "a servability count is not positive"
        assert self._serve_count == expected, "servability counts disagree with the checkpoints"
