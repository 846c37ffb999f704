"""Joint prefix hits over KV blocks and KDA state checkpoints, and where checkpoints get filed.

A KV hit alone is worth nothing to a hybrid model: the KDA layers need their state exactly where
the hit ends. The joint hit is the longest prefix P with every KV block of [0, P) cached and a
checkpoint at P. Checkpoints sit on one grid (`core/checkpoint_grid.py`): multiples of both the KV
block size and the chunk of fla's KDA kernels. They are filed at
  - rungs: every `checkpoint_interval` tokens inside a prompt (a multiple of the grid);
  - the prompt-end anchor: the last grid point of the prompt;
  - the end-of-sequence anchor: the last grid point prompt + output reached (filed by the
    scheduler from the request's boundary slot when it finishes);
  - demand: grid points where a lookup found KV reuse that only a missing checkpoint declined.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deltaserve.core.block_hash import BlockHash, append_block_hashes
from deltaserve.core.checkpoint_grid import KERNEL_CHUNK_TOKENS, checkpoint_grid
from deltaserve.core.checkpoint_pool import Checkpoint, CheckpointKind, CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.request import Request

MAX_DEMANDS = 4096


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # P: tokens the request can skip
    block_ids: list[int]  # the cached blocks of [0, P)
    checkpoint: Checkpoint | None  # the state at P (None when P == 0)
    num_kv_hit_tokens: int  # the longest cached KV prefix, checkpoint or not


@dataclass
class PrefixCacheStats:
    """Running totals. queries, queried_tokens and hit_tokens count each request once, at its first
    admission (its prompt, and the hit `num_cached_tokens` reports), as vLLM's prefix-cache stats do;
    re-admissions after a preemption go to the preempted_* totals instead, since a request may be
    preempted any number of times. kv_hit_tokens and tokens_lost_to_missing_checkpoint cover every
    admission."""

    queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    preempted_queries: int = 0
    preempted_queried_tokens: int = 0
    preempted_hit_tokens: int = 0
    kv_hit_tokens: int = 0
    tokens_lost_to_missing_checkpoint: int = 0
    demands_recorded: int = 0


class PrefixCache:
    """Composes the KV cache manager and the checkpoint pool into joint lookups and filing decisions."""

    def __init__(self, kv: KVCacheManager, checkpoints: CheckpointPool, checkpoint_interval: int,
                 kernel_chunk: int = KERNEL_CHUNK_TOKENS, offload_chunk: int = 1) -> None:
        """`kernel_chunk` is fla's chunk in the engine; only tests with tiny workloads make it smaller.
        `offload_chunk`: with the offload tier on, its chunk in tokens; every anchor, rung and demand
        checkpoint is then floored to a grid the chunk divides, so each can be stored in the tier."""
        self.grid = checkpoint_grid(kv.block_size, kernel_chunk, offload_chunk)
        if checkpoint_interval % self.grid:
            raise ValueError(
                f"state_checkpoint_interval={checkpoint_interval} must be a multiple of the checkpoint grid "
                f"({self.grid} tokens: block_size={kv.block_size}, the kernel chunk of {kernel_chunk}"
                + (f" and the offload chunk of {offload_chunk}" if offload_chunk > 1 else "") + ")"
            )
        self.kv = kv
        self.checkpoints = checkpoints
        self.block_size = kv.block_size
        self.checkpoint_interval = checkpoint_interval
        self.stats = PrefixCacheStats()
        self._demand: OrderedDict[BlockHash, None] = OrderedDict()
        kv.pool.on_drop = checkpoints.drop
        checkpoints.on_change = kv.pool.add_servability

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's full-block hashes over prompt + output so far (cached on the request)."""
        hashes, bs = request.block_hashes, self.block_size
        done = len(hashes) * bs
        if done + bs > request.num_tokens:
            return hashes  # no new full block
        new_tokens = request.token_slice(done, request.num_tokens // bs * bs)  # not the whole context
        return append_block_hashes(hashes, new_tokens, bs)

    def lookup(self, request: Request) -> PrefixHit:
        """The joint hit for a request about to start; never covers its last token (its logits are needed)."""
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        kv_blocks = self.kv.cached_prefix(hashes, max_blocks)
        hit_blocks, checkpoint = 0, None
        per_grid = self.grid // self.block_size
        last_grid_blocks = len(kv_blocks) // per_grid * per_grid
        for n in range(last_grid_blocks, 0, -per_grid):
            checkpoint = self.checkpoints.lookup(hashes[n - 1])
            if checkpoint is not None:
                hit_blocks = n
                break
        if last_grid_blocks > hit_blocks:
            self._record_demand(hashes[last_grid_blocks - 1])
        bs = self.block_size
        return PrefixHit(hit_blocks * bs, kv_blocks[:hit_blocks], checkpoint, len(kv_blocks) * bs)

    def account(self, request: Request, hit: PrefixHit) -> None:
        """Count the lookup of a request that was admitted with this hit: its first admission in
        queries, queried_tokens and hit_tokens, a re-admission after a preemption in preempted_*."""
        stats = self.stats
        if request.num_preemptions == 0:
            stats.queries += 1
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += hit.num_tokens
        else:
            stats.preempted_queries += 1
            stats.preempted_queried_tokens += request.num_tokens
            stats.preempted_hit_tokens += hit.num_tokens
        stats.kv_hit_tokens += hit.num_kv_hit_tokens
        stats.tokens_lost_to_missing_checkpoint += hit.num_kv_hit_tokens - hit.num_tokens

    def _record_demand(self, block_hash: BlockHash) -> None:
        if block_hash not in self._demand:
            self.stats.demands_recorded += 1
        self._demand[block_hash] = None
        self._demand.move_to_end(block_hash)
        while len(self._demand) > MAX_DEMANDS:
            self._demand.popitem(last=False)

    def boundaries(self, request: Request, start: int, end: int) -> list[tuple[int, CheckpointKind]]:
        """The grid points b in (start, end], in order, where computing [start, end) should file a
        checkpoint, each with its kind."""
        bs, grid = self.block_size, self.grid
        prompt_end = request.num_prompt_tokens // grid * grid
        hashes = self.block_hashes(request)
        found = []
        b = (start // grid + 1) * grid
        while b <= end:
            h = hashes[b // bs - 1] if b // bs <= len(hashes) else None
            if h is not None and self.checkpoints.get(h) is None:
                if b == prompt_end:
                    found.append((b, CheckpointKind.PROMPT_END))
                elif b < request.num_prompt_tokens and b % self.checkpoint_interval == 0:
                    found.append((b, CheckpointKind.RUNG))
                elif h in self._demand:
                    found.append((b, CheckpointKind.DEMAND))
            b += grid
        return found

    def file(self, request: Request, num_tokens: int, kind: CheckpointKind) -> Checkpoint | None:
        """Reserve a checkpoint at boundary `num_tokens` of this request (None: exists or no room)."""
        h = self.block_hashes(request)[num_tokens // self.block_size - 1]
        cp = self.checkpoints.file(h, num_tokens, kind)
        if cp is not None:
            self._demand.pop(h, None)
        return cp
