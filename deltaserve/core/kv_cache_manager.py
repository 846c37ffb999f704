"""Per-request block tables over the paged MLA latent cache."""

from __future__ import annotations

from deltaserve.core.block_pool import BlockPool
from deltaserve.core.kv_cache_spec import MLALatentSpec


class KVCacheManager:
    """Grows each request's block table as its computed tokens grow; frees it when it ends."""

    def __init__(self, spec: MLALatentSpec, num_blocks: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks still to allocate so that `num_tokens` tokens of this request have a slot."""
        return max(0, self.spec.blocks_for(num_tokens) - len(self._tables.get(request_id, ())))

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make room for `num_tokens` tokens in total; the new block table, or None (nothing changed)."""
        need = self.num_blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free_blocks:
            return None
        table = self._tables.setdefault(request_id, [])
        table.extend(self.pool.allocate(need))
        return table

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            # release the tail first so the head (the prefix) is the last to be reused
            self.pool.release(table[::-1])
