"""Per-request block tables over the paged MLA latent cache, with prefix caching of full blocks."""

from __future__ import annotations

from deltaserve.core.block_hash import BlockHash
from deltaserve.core.block_pool import BlockPool
from deltaserve.core.kv_cache_spec import MLALatentSpec


class KVCacheManager:
    """Grows each request's block table as its computed tokens grow; releases it when it ends.

    With prefix caching, computed full blocks are filed under their chained hash (`commit`), a new
    request can start from cached blocks (`cached_prefix` then `allocate_slots(..., prefix=...)`),
    and released blocks stay findable until reused.
    """

    def __init__(self, spec: MLALatentSpec, num_blocks: int, enable_prefix_caching: bool = False) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0 (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, num_tokens: int, num_prefix_blocks: int = 0) -> int:
        """Fresh blocks to allocate so that `num_tokens` tokens of this request have a slot."""
        have = len(self._tables.get(request_id, ())) or num_prefix_blocks
        return max(0, self.spec.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Whether `allocate_slots` would succeed. Free cached prefix blocks stop counting as free once
        taken, so they are subtracted."""
        taken = sum(1 for b in prefix if self.pool.ref_count(b) == 0)
        need = self.num_blocks_needed(request_id, num_tokens, len(prefix))
        return need + taken <= self.pool.num_free_blocks

    def cached_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """Block ids of the longest run of cached blocks at the start of `block_hashes` (at most max_blocks)."""
        if not self.enable_prefix_caching:
            return []
        ids = []
        for h in block_hashes[:max_blocks]:
            block = self.pool.cached_block(h)
            if block is None:
                break
            ids.append(block)
        return ids

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: list[int] = ()) -> list[int] | None:
        """Make room for `num_tokens` tokens in total, starting a new table from the cached `prefix`
        blocks; the block table, or None when there are not enough free blocks (nothing changed)."""
        if not self.can_allocate(request_id, num_tokens, prefix):
            return None
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = []
            if prefix:
                self.pool.touch(list(prefix))
                table.extend(prefix)
                self._num_committed[request_id] = len(prefix)
        table.extend(self.pool.allocate(self.spec.blocks_for(num_tokens) - len(table)))
        return table

    def commit(self, request_id: str, block_hashes: list[BlockHash], num_computed_tokens: int) -> None:
        """File the request's blocks that are now full and computed under their hashes."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        done = self._num_committed.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for i in range(done, full):
            self.pool.cache_block(table[i], block_hashes[i], block_hashes[i - 1] if i else None)
        self._num_committed[request_id] = max(done, full)

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        if table:
            # tail first: the end of a sequence is less likely to be shared than its head
            self.pool.release(table[::-1])
