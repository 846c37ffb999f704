"""The scheduler's index of what the offload tier holds, and its joint hits on the chunk grid.

The tier stores a request's KV in chunks of `chunk_tokens` tokens and KDA state images at chunk-grid
boundaries, each keyed by the chained hash of the block that ends there (core/block_hash.py). The
engine core cannot ask every rank's tier on each admission, so it keeps this index: pure Python,
updated when every stage and rank has reported a save (`add_kv`, `add_state`), and evicting by the
same least-recently-used byte rule as the tiers (offload/tiers.py), so an entry it still lists is one
the tiers still hold unless a load finds otherwise (then `forget`).

Under pipeline parallelism each stage's tier evicts by its own objects' sizes; the index charges
each entry the largest size any stage stores for it (`kv_chunk_bytes`, `state_image_bytes`: the
maxima over stages, agreed in the joint spec), so it never lists what the fullest stage evicted.

A joint hit (`lookup`) is the longest prefix whose KV chunks are all listed and whose last chunk ends
in a listed state image; it is worth loading only past what HBM already holds, and is counted as a
whole: a load that misses any part is a miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.core.block_hash import BlockHash


@dataclass(frozen=True)
class TierHit:
    """A joint hit in the tier: the first `num_tokens` tokens (a multiple of the chunk)."""

    num_tokens: int
    kv_chunk_hashes: list[BlockHash]  # the hash ending each chunk to load, first chunk past `start_tokens`
    state_hash: BlockHash  # the image at num_tokens
    start_tokens: int  # the chunk-grid point the load starts at (what HBM holds below it is kept)


@dataclass
class TierIndexStats:
    """Per lookup: a request that found a hit but waits for blocks looks (and counts) again next step;
    the loads ordered and done are OffloadScheduler's counters."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    kv_evictions: int = 0
    state_evictions: int = 0
    forgotten: int = 0


class TierIndex:
    def __init__(self, capacity_bytes: int, chunk_tokens: int, block_size: int, kv_chunk_bytes: int,
                 state_image_bytes: int) -> None:
        """capacity_bytes: each stage's tier budget (the smallest tier listed); chunk_tokens: a
        multiple of block_size; kv_chunk_bytes / state_image_bytes: the largest stored object of a
        chunk / an image on any stage (header included)."""
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"kv_offloading_chunk_size={chunk_tokens} must be a positive multiple of the block "
                             f"size {block_size}")
        if min(kv_chunk_bytes, state_image_bytes) <= 0 or capacity_bytes < kv_chunk_bytes + state_image_bytes:
            raise ValueError(f"the offload tier of {capacity_bytes} bytes cannot hold one KV chunk "
                             f"({kv_chunk_bytes} bytes) and one state image ({state_image_bytes} bytes)")
        self.capacity_bytes = capacity_bytes
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.kv_chunk_bytes = kv_chunk_bytes
        self.state_image_bytes = state_image_bytes
        self._entries: OrderedDict[tuple[str, BlockHash], int] = OrderedDict()  # LRU first
        self.used_bytes = 0
        self.stats = TierIndexStats()

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def chunk_hashes(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The hash ending each whole chunk of a request's full-block hashes."""
        per = self.blocks_per_chunk
        return [block_hashes[i - 1] for i in range(per, len(block_hashes) + 1, per)]

    # What the tier holds ------------------------------------------------------------------
    def add_kv(self, chunk_hash: BlockHash) -> None:
        """Every stage and rank stored the KV chunk ending at `chunk_hash`."""
        self._add(("kv", chunk_hash), self.kv_chunk_bytes)

    def add_state(self, boundary_hash: BlockHash) -> None:
        """Every stage and rank stored the state image at the boundary ending at `boundary_hash`."""
        self._add(("state", boundary_hash), self.state_image_bytes)

    def has_kv(self, chunk_hash: BlockHash) -> bool:
        return ("kv", chunk_hash) in self._entries

    def has_state(self, boundary_hash: BlockHash) -> bool:
        return ("state", boundary_hash) in self._entries

    def forget(self, kind: str, block_hash: BlockHash) -> None:
        """A load found the object gone or corrupt on some rank: stop listing it."""
        size = self._entries.pop((kind, block_hash), None)
        if size is not None:
            self.used_bytes -= size
            self.stats.forgotten += 1

    def _add(self, key: tuple[str, BlockHash], size: int) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = size
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:
            victim = self._next_victim()
            self.used_bytes -= self._entries.pop(victim)
            if victim[0] == "kv":
                self.stats.kv_evictions += 1
            else:
                self.stats.state_evictions += 1

    def _next_victim(self) -> tuple[str, BlockHash]:
        """The entry to evict next: the least recently used, as the tiers evict theirs."""
        return next(iter(self._entries))

    # Joint hits ----------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash], num_tokens: int, hbm_hit_tokens: int,
               hbm_kv_tokens: int | None = None) -> TierHit | None:
        """The longest joint hit of a request with `num_tokens` tokens whose full blocks hash to
        `block_hashes`, if it reaches past `hbm_hit_tokens` (HBM's joint hit); never covering the last
        token (its logits are needed). `hbm_kv_tokens` (at least hbm_hit_tokens; default equal): the
        KV prefix HBM holds, whose chunks need not be in the tier; a state image of the tier may end
        inside it (HBM kept the KV but evicted the checkpoint). Touches what it hits, as a load would."""
        self.stats.lookups += 1
        chunks = self.chunk_hashes(block_hashes)
        max_chunks = (num_tokens - 1) // self.chunk_tokens
        kv_in_hbm = max(hbm_hit_tokens, hbm_kv_tokens or 0) // self.chunk_tokens
        best = 0
        for n in range(1, min(len(chunks), max_chunks) + 1):
            if n > kv_in_hbm and not self.has_kv(chunks[n - 1]):
                break
            if self.has_state(chunks[n - 1]):
                best = n
        if best * self.chunk_tokens <= hbm_hit_tokens:
            return None
        start_chunk = min(kv_in_hbm, best)  # the KV below it is in HBM already
        for h in chunks[start_chunk:best]:
            self._entries.move_to_end(("kv", h))
        self._entries.move_to_end(("state", chunks[best - 1]))
        self.stats.hits += 1
        self.stats.hit_tokens += best * self.chunk_tokens - hbm_hit_tokens
        return TierHit(best * self.chunk_tokens, chunks[start_chunk:best], chunks[best - 1],
                       start_chunk * self.chunk_tokens)

    def snapshot(self) -> dict[str, int]:
        """Plain numbers for metrics."""
        kv = sum(1 for kind, _ in self._entries if kind == "kv")
        return {"used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes, "kv_chunks": kv,
                "state_images": len(self._entries) - kv, **vars(self.stats)}
