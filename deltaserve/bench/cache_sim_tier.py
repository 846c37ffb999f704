"""The offload tier in the cache simulator: its index sized in the engine's bytes, and an ideal rank side.

The simulator has no model, but the tier's index is byte-capped, so its objects get the sizes the
engine would store for the 48B shape (preset "kimi-linear-48b-a3b", bfloat16, one rank: TP = PP =
DCP = 1), built from the same specs as the worker's `cache_specs()`:

  - a KV chunk of `chunk_tokens` tokens: len(mla_layer_ids) * latent_dim * 2 bytes per token, times
    chunk_tokens (7 * 576 * 2 = 8,064 B a token; 4,128,768 B for 512 tokens);
  - a state image: per KDA layer the conv window (3 * linear_num_heads * linear_head_dim channels *
    (short_conv_kernel_size - 1) * 2 B) and the fp32 recurrent state (linear_num_heads *
    linear_head_dim^2 * 4 B): 20 * (73,728 + 2,097,152) = 43,417,600 B;

each stored as one object, header and fingerprint included (`rank_object_bytes`), as
offload/scheduler_side.py `tier_index_for` charges them.

The rank side is ideal and lossless: every save and every load a step orders is reported done in
that same step's update, so the only limits are the tier's bytes (LRU eviction) and the scheduler's
`max_pending_saves` (saves planned in one step beyond it are skipped, as in the engine). Since saves
finish within their step, the limit caps the saves planned per step.

HBM at the 48B shape on one H200 (the sizes the results were run with, not the CLI's defaults):
`--kv-blocks 5379 --checkpoint-units 71 --intervals 8192`. The cache budget is the H200 plan of
benchmarks/results/h200_2026-12-03.json (30,895,187,968 B at gpu_memory_utilization 0.9); with
prefix caching each of the 64 concurrent requests holds two state slots (128 x 43,417,600 B), 71
checkpoint images (the issue's count; 42 units of 1 MiB each) take 3,126,853,632 B, and the rest is
5,379 blocks of 4,128,768 B (512 tokens). 8192 is the engine's default interval for this shape
(cache_sizing.default_checkpoint_interval).
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Sequence

from deltaserve.bench.mooncake import TRACE_BLOCK_TOKENS
from deltaserve.config.engine_config import parse_bytes
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.block_hash import BlockHash
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.model_files.presets import PRESETS
from deltaserve.offload.metadata import OffloadMetadata, OffloadOutput
from deltaserve.offload.objects import rank_object_bytes
from deltaserve.offload.scheduler_side import OffloadScheduler
from deltaserve.offload.tier_index import TierIndex

MODEL_PRESET = "kimi-linear-48b-a3b"
DTYPE_BYTES = 2  # bfloat16 latents and conv window; the recurrent state is fp32 (the spec's default)
GiB = 1 << 30


def model_cache_specs(preset: str = MODEL_PRESET, block_size: int = TRACE_BLOCK_TOKENS
                      ) -> tuple[MLALatentSpec, KDAStateSpec]:
    """The engine's cache specs for `preset` on one rank (worker.cache_specs with TP = DCP = 1)."""
    config = KimiLinearConfig.from_dict(PRESETS[preset])
    kv = MLALatentSpec(block_size=block_size, num_layers=len(config.mla_layer_ids), latent_dim=config.latent_dim,
                       dtype_bytes=DTYPE_BYTES)
    state = KDAStateSpec(num_layers=len(config.kda_layer_ids), num_heads=config.linear_num_heads,
                         head_k_dim=config.linear_head_dim, head_v_dim=config.linear_head_dim,
                         conv_dim=3 * config.kda_qkv_dim, conv_window=config.short_conv_kernel_size - 1,
                         conv_dtype_bytes=DTYPE_BYTES)
    return kv, state


def tier_object_bytes(chunk_tokens: int, preset: str = MODEL_PRESET) -> tuple[int, int]:
    """(stored bytes of one KV chunk of `chunk_tokens` tokens, stored bytes of one state image)."""
    kv, state = model_cache_specs(preset)
    return rank_object_bytes(chunk_tokens * kv.bytes_per_token), rank_object_bytes(state.bytes_per_image)


NEVER = 1 << 62  # the next use of an object no later request reads


class ClairvoyantTierIndex(TierIndex):
    """A bound, not a policy: the tier index evicting the object whose next reader comes last.

    `uses` maps each full-block hash of the trace's prompts to the sorted indices of the requests whose
    prompts hold it (the trace's future, which no engine knows). Eviction takes the object whose next
    use at or after the replay's frontier (`advance`) is farthest, never-read objects first: Belady's
    rule. With objects of two sizes and hits that need a prefix's chunks and its image together it is
    not the exact optimum, but no recency rule is expected to beat it by much, so the gap between it
    and LRU is what a better eviction policy could win at that capacity.
    """

    def __init__(self, *args, uses: dict[BlockHash, list[int]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._uses = uses
        self._frontier = 0
        self._next_use: dict[tuple[str, BlockHash], int] = {}
        self._heap: list[tuple[int, tuple[str, BlockHash]]] = []  # (-next use, key), stale ones skipped
        self._due: dict[int, list[tuple[str, BlockHash]]] = defaultdict(list)  # next use -> keys

    def _schedule(self, key: tuple[str, BlockHash]) -> None:
        uses = self._uses.get(key[1], [])
        at = bisect.bisect_left(uses, self._frontier)
        nxt = uses[at] if at < len(uses) else NEVER
        self._next_use[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))
        if nxt != NEVER:
            self._due[nxt].append(key)

    def advance(self, frontier: int) -> None:
        """Every request before `frontier` has looked up: their uses are past."""
        old, self._frontier = self._frontier, max(frontier, self._frontier)
        for index in range(old, self._frontier):
            for key in self._due.pop(index, []):
                if key in self._entries and self._next_use.get(key) == index:
                    self._schedule(key)

    def _add(self, key: tuple[str, BlockHash], size: int) -> None:
        if key not in self._entries:
            self._schedule(key)
        super()._add(key, size)

    def _next_victim(self) -> tuple[str, BlockHash]:
        while True:
            neg_next, victim = heapq.heappop(self._heap)
            if victim in self._entries and self._next_use.get(victim) == -neg_next:  # else evicted or rescheduled
                del self._next_use[victim]
                return victim


def prompt_block_uses(block_hashes: Sequence[Sequence[BlockHash]]) -> dict[BlockHash, list[int]]:
    """For ClairvoyantTierIndex: each hash -> the indices of the prompts (in order) holding it."""
    uses: dict[BlockHash, list[int]] = defaultdict(list)
    for i, hashes in enumerate(block_hashes):
        for h in hashes:
            uses[h].append(i)
    return uses


def build_offload(tier_bytes: int, chunk_tokens: int, max_pending_saves: int,
                  uses: dict[BlockHash, list[int]] | None = None) -> OffloadScheduler | None:
    """The tier's scheduler side over a `tier_bytes` index (None for 0: HBM only); with `uses`, the
    clairvoyant index (a bound for eviction policies) instead of LRU."""
    if tier_bytes == 0:
        return None
    if chunk_tokens <= 0 or chunk_tokens % TRACE_BLOCK_TOKENS:
        raise ValueError(f"--tier-chunk-tokens={chunk_tokens} must be a positive multiple of the "
                         f"{TRACE_BLOCK_TOKENS}-token trace block")
    kv_chunk_bytes, image_bytes = tier_object_bytes(chunk_tokens)
    sizes = (tier_bytes, chunk_tokens, TRACE_BLOCK_TOKENS, kv_chunk_bytes, image_bytes)
    index = TierIndex(*sizes) if uses is None else ClairvoyantTierIndex(*sizes, uses=uses)
    return OffloadScheduler(index, max_pending_saves)


def ideal_report(meta: OffloadMetadata | None) -> OffloadOutput | None:
    """Every rank stored every save and loaded every load of the step that carried them."""
    if meta is None:
        return None
    saves = meta.saves_before + meta.saves_after
    return OffloadOutput(saves_done=[s.save_id for s in saves], loads_done=[load.request_id for load in meta.loads])


def tier_results(offload: OffloadScheduler | None, tier_bytes: int, chunk_tokens: int,
                 max_pending_saves: int) -> dict:
    """The tier's columns of a result row (zeros and no index for HBM only). Loads and tokens count
    every admission, re-admissions after a preemption included: tier_loaded_tokens the KV the loads
    moved, tier_hit_tokens what they added past HBM's joint hit (a hit whose KV HBM still held and
    whose state image only the tier kept moves no KV but adds the whole stretch)."""
    row = {"tier_bytes": tier_bytes, "tier_chunk_tokens": chunk_tokens, "tier_max_pending_saves": max_pending_saves}
    if offload is None:
        return {**row, "tier_loads": 0, "tier_loaded_tokens": 0, "tier_hit_tokens": 0, "tier_saves_done": 0,
                "tier_saves_skipped": 0, "tier_index": None}
    stats = offload.stats
    return {**row, "tier_loads": stats.loads_done, "tier_loaded_tokens": stats.loaded_tokens,
            "tier_hit_tokens": stats.hit_tokens, "tier_saves_done": stats.saves_done,
            "tier_saves_skipped": stats.saves_skipped, "tier_index": offload.index.snapshot()}


def parse_tier_sizes(text: str) -> list[int]:
    """`0,64GiB,256GiB` -> bytes; 0 is HBM only."""
    return [0 if x.strip() == "0" else parse_bytes(x, "--tier-bytes") for x in text.split(",") if x.strip()]


def format_bytes(n: int) -> str:
    """Whole GiB as `256GiB`, anything else in bytes; 0 as `0` (HBM only)."""
    return f"{n // GiB}GiB" if n and n % GiB == 0 else str(n)
