"""The offload tier's scheduler side: pure Python, in the engine core beside the scheduler.

It decides what the tier stores and what a request loads from it; the ranks (worker_side.py) only
move bytes. What it keeps:
- the TierIndex (tier_index.py) of what every rank has stored, updated when every rank reported a
  save, so a lookup never needs the ranks;
- the saves in flight: at most `max_pending_saves` (a save is one checkpoint's state image and the
  KV chunks before it that the tier lacks); a save planned beyond that is deferred, never waited for
  (the step loop does not wait on the tier): a later step stores it once a save has finished, if HBM
  still holds the checkpoint and its KV blocks (the scheduler pins the checkpoint for that step), and
  drops it otherwise, which only costs a future hit;
- the orders for the coming step (`build_meta`).

Write-through at save: whenever a checkpoint on the chunk grid is saved into HBM checkpoint units
(a rung, the prompt-end anchor, a demand rung, the end-of-sequence anchor), the same step stores
its image and the KV chunks up to it in the tier, so what HBM later evicts is already there.

A tier hit is loaded like a P/D consumer's remote prefill: the request gets blocks and its state
slot, waits (WAITING_FOR_TIER_LOAD) while the load runs on every rank, then runs from the hit; a
failed load (an object evicted, corrupt or lost on any rank) frees them and the request is admitted
again without the tier (it recomputes from its HBM hit).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.core.block_hash import BlockHash
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.offload.metadata import KVChunkRef, OffloadLoad, OffloadMetadata, OffloadOutput, OffloadSave
from deltaserve.offload.objects import rank_object_bytes
from deltaserve.offload.tier_index import TierHit, TierIndex


@dataclass
class OffloadSchedulerStats:
    saves_planned: int = 0
    saves_skipped: int = 0  # found max_pending_saves in flight: deferred
    saves_dropped: int = 0  # deferred, then gone from HBM (or past MAX_DEFERRED) before a slot freed
    saves_done: int = 0  # stored by every rank
    saves_failed: int = 0  # some rank did not store it
    loads_ordered: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    loaded_tokens: int = 0  # tokens whose KV loads brought back (what HBM held below them not counted)
    hit_tokens: int = 0  # prompt tokens finished loads added to the HBM hit (the tier's share of hit_tokens)


DEFAULT_REMOTE_SEGMENT_BYTES = 1 << 30  # each rank's share of a Mooncake Store without kv_offloading_size


def rank_tier_capacities(engine_config: Any, world_size: int) -> list[int]:
    """Each configured tier's bytes on one rank, fastest first: host, disk (their sizes are summed
    over the ranks, so each rank takes its share), then the segment a rank gives a Mooncake Store
    (its share of kv_offloading_size, at least the client's minimum; 1 GiB without a host size)."""
    sizes = []
    if engine_config.kv_offloading_size:
        sizes.append(engine_config.kv_offloading_size // world_size)
    if engine_config.kv_offloading_disk_path:
        sizes.append(engine_config.kv_offloading_disk_size // world_size)
    if engine_config.kv_offloading_remote:
        from deltaserve.offload.mooncake_tier import MIN_SEGMENT_BYTES

        sizes.append(max(MIN_SEGMENT_BYTES, (engine_config.kv_offloading_size or 0) // world_size
                         or DEFAULT_REMOTE_SEGMENT_BYTES))
    return sizes


def tier_index_for(engine_config: Any, stage_specs: Sequence[tuple[MLALatentSpec, KDAStateSpec]]) -> TierIndex:
    """The index of an engine's tier: each rank's share of the largest tier (write-through: it holds
    what the faster ones evicted), every object charged the largest size any stage stores for it."""
    world = engine_config.parallel.world_size
    chunk = engine_config.kv_offloading_chunk_size
    blocks_per_chunk = chunk // engine_config.scheduler_block_size
    kv_bytes = max(rank_object_bytes(blocks_per_chunk * kv.bytes_per_block) for kv, _ in stage_specs)
    image_bytes = max(rank_object_bytes(state.bytes_per_image) for _, state in stage_specs)
    return TierIndex(max(rank_tier_capacities(engine_config, world)), chunk, engine_config.scheduler_block_size,
                     kv_bytes, image_bytes)


MAX_DEFERRED = 4096  # deferred saves kept, the oldest dropped first


class OffloadScheduler:
    def __init__(self, index: TierIndex, max_pending_saves: int) -> None:
        if max_pending_saves < 1:
            raise ValueError(f"kv_offloading_max_pending_saves={max_pending_saves} must be >= 1")
        self.index = index
        self.max_pending_saves = max_pending_saves
        self.block_size = index.block_size
        self.stats = OffloadSchedulerStats()
        self._pending: dict[int, tuple[list[BlockHash], BlockHash | None]] = {}  # save id -> (kv, state)
        self._pending_kv: set[BlockHash] = set()
        self._pending_state: set[BlockHash] = set()
        self._next_save_id = 0
        self._saves_before: list[OffloadSave] = []
        self._saves_after: list[OffloadSave] = []
        self._loads: list[OffloadLoad] = []
        self._load_hits: dict[str, tuple[TierHit, int]] = {}  # loads in flight, with the HBM hit they beat
        # deferred saves, oldest first: the image's block hash -> (its HBM checkpoint, block hashes up to it)
        self._deferred: OrderedDict[BlockHash, tuple[Any, list[BlockHash]]] = OrderedDict()

    @property
    def chunk_tokens(self) -> int:
        return self.index.chunk_tokens

    @property
    def has_pending(self) -> bool:
        """Saves or loads whose reports are still to come: steps must keep polling the ranks."""
        return bool(self._pending or self._load_hits)

    @property
    def num_pending_saves(self) -> int:
        return len(self._pending)

    # Saves -----------------------------------------------------------------------------------
    def plan_save(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], num_tokens: int,
                  unit_ids: Sequence[int], *, before_forward: bool, checkpoint: Any = None) -> bool:
        """Store the checkpoint at `num_tokens` (a chunk-grid point; its image in checkpoint units
        `unit_ids`) and the KV chunks before it that the tier lacks, from `block_ids` (the request's
        table) in the step being scheduled: before its forward (an end-of-sequence checkpoint saved
        by saves_before, or a deferred save) or after it (one its saves_after writes). False when
        nothing was planned; with max_pending_saves in flight, `checkpoint` (the HBM one) is
        deferred (`next_deferred`)."""
        if num_tokens % self.chunk_tokens:
            raise ValueError(f"an offloaded checkpoint at {num_tokens} tokens is off the {self.chunk_tokens}-token "
                             "chunk grid")
        num_blocks = num_tokens // self.block_size
        if len(block_hashes) < num_blocks or len(block_ids) < num_blocks:
            return False
        per = self.index.blocks_per_chunk
        chunks = [KVChunkRef(block_hashes[end - 1], list(block_ids[end - per:end]))
                  for end in range(per, num_blocks + 1, per)
                  if not self.index.has_kv(block_hashes[end - 1]) and block_hashes[end - 1] not in self._pending_kv]
        state_hash = block_hashes[num_blocks - 1]
        if self.index.has_state(state_hash) or state_hash in self._pending_state:
            if not chunks:
                return False
            state = None  # the image is stored or on its way: only the KV chunks are missing
        else:
            state = state_hash
        if len(self._pending) >= self.max_pending_saves:
            self.stats.saves_skipped += 1
            if checkpoint is not None:
                self._deferred[state_hash] = (checkpoint, list(block_hashes[:num_blocks]))
                self._deferred.move_to_end(state_hash)
                while len(self._deferred) > MAX_DEFERRED:
                    self._deferred.popitem(last=False)
                    self.stats.saves_dropped += 1
            return False
        save = OffloadSave(self._next_save_id, chunks, state, list(unit_ids) if state is not None else [])
        self._next_save_id += 1
        self._pending[save.save_id] = ([c.block_hash for c in chunks], state)
        self._pending_kv.update(c.block_hash for c in chunks)
        if state is not None:
            self._pending_state.add(state)
        (self._saves_before if before_forward else self._saves_after).append(save)
        self.stats.saves_planned += 1
        return True

    def next_deferred(self) -> tuple[Any, list[BlockHash]] | None:
        """The oldest deferred save (its HBM checkpoint, block hashes up to it) while a save may be
        planned, else None. The caller plans it (`plan_save`) or drops it (`drop_deferred`)."""
        if not self._deferred or len(self._pending) >= self.max_pending_saves:
            return None
        return self._deferred.popitem(last=False)[1]

    def drop_deferred(self) -> None:
        """Count a deferred save whose checkpoint or KV blocks HBM no longer holds."""
        self.stats.saves_dropped += 1

    # Loads -----------------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash], num_tokens: int, hbm_kv_tokens: int,
               hbm_hit_tokens: int) -> TierHit | None:
        """The tier's joint hit for a request about to be admitted, if it beats HBM's."""
        return self.index.lookup(block_hashes, num_tokens, hbm_hit_tokens, hbm_kv_tokens=hbm_kv_tokens)

    def order_load(self, request_id: str, hit: TierHit, table: Sequence[int], state_slot: int,
                   hbm_hit_tokens: int) -> None:
        """Load `hit` into the request's `table` (its blocks from hit.start_tokens on are fresh) and
        `state_slot`, in the step being scheduled; `hbm_hit_tokens`: the HBM hit it beats."""
        per, first = self.index.blocks_per_chunk, hit.start_tokens // self.block_size
        chunks = [KVChunkRef(h, list(table[first + i * per:first + (i + 1) * per]))
                  for i, h in enumerate(hit.kv_chunk_hashes)]
        self._loads.append(OffloadLoad(request_id, chunks, hit.state_hash, state_slot))
        self._load_hits[request_id] = (hit, hbm_hit_tokens)
        self.stats.loads_ordered += 1

    def build_meta(self) -> OffloadMetadata | None:
        """The saves and loads of the coming step (None when there are none)."""
        if not (self._saves_before or self._saves_after or self._loads):
            return None
        meta = OffloadMetadata(self._saves_before, self._loads, self._saves_after)
        self._saves_before, self._saves_after, self._loads = [], [], []
        return meta

    # Reports ---------------------------------------------------------------------------------
    def apply(self, output: OffloadOutput) -> tuple[list[str], dict[str, str]]:
        """Every rank's reports, joined: the index learns what was stored; returns (requests whose
        load finished, requests whose load failed -> why). A failed load's objects leave the index."""
        for save_id in output.saves_done + output.saves_failed:
            kv, state = self._pending.pop(save_id)
            self._pending_kv.difference_update(kv)
            if state is not None:
                self._pending_state.discard(state)
            if save_id in output.saves_failed:
                self.stats.saves_failed += 1
                continue
            self.stats.saves_done += 1
            for h in kv:
                self.index.add_kv(h)
            if state is not None:
                self.index.add_state(state)
        done = []
        for request_id in output.loads_done:
            loaded = self._load_hits.pop(request_id, None)
            if loaded is not None:
                hit, hbm_hit_tokens = loaded
                done.append(request_id)
                self.stats.loads_done += 1
                self.stats.loaded_tokens += hit.num_tokens - hit.start_tokens
                self.stats.hit_tokens += hit.num_tokens - hbm_hit_tokens
        failed: dict[str, str] = {}
        for request_id, why in output.loads_failed.items():
            loaded = self._load_hits.pop(request_id, None)
            if loaded is None:
                continue
            hit = loaded[0]
            failed[request_id] = why
            self.stats.loads_failed += 1
            self.index.forget("state", hit.state_hash)
            for h in hit.kv_chunk_hashes:
                self.index.forget("kv", h)
        return done, failed

    def snapshot(self, rank_stats: dict[int, dict] | None = None) -> dict[str, Any]:
        """Plain numbers for metrics: this side's counters, the index, and from each rank's latest
        report (`rank_stats`: global rank -> {"rank": RankOffloader counters, "tiers": per tier}) the
        tiers' counters summed over the ranks, by tier name (a tier is degraded if it is on any rank)."""
        tiers: dict[str, dict[str, float]] = {}
        ranks: dict[str, float] = {}
        for report in (rank_stats or {}).values():
            for name, row in report.get("tiers", {}).items():
                summed = tiers.setdefault(name, {})
                for key, value in row.items():
                    summed[key] = max(summed.get(key, 0), value) if key == "degraded" else summed.get(key, 0) + value
            for key, value in report.get("rank", {}).items():
                ranks[key] = ranks.get(key, 0) + value
        return {**vars(self.stats), "pending_saves": len(self._pending), "deferred_saves": len(self._deferred),
                "index": self.index.snapshot(),
                "tiers": tiers, "ranks": ranks}
