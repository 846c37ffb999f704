"""The offload tier's part of the scheduler (deltaserve/offload/scheduler_side.py holds the tier's own
bookkeeping): deferred saves planned before a step's forward, tier hits admitted to
`WAITING_FOR_TIER_LOAD`, and finished or failed loads. A mixin of `Scheduler`, on its attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltaserve.core.prefix_cache import PrefixHit
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler_output import NewRequestData
from deltaserve.offload.metadata import OffloadOutput
from deltaserve.offload.tier_index import TierHit
from deltaserve.sampling_params import wants_cache

if TYPE_CHECKING:
    from deltaserve.core.scheduler import StepRecord, _StepBuilder


class TierScheduling:
    def _offloads(self, request: Request) -> bool:
        """Whether the tier stores this request's checkpoints: all of them, or under the
        "cache_control" admission only those of requests that carry the hint."""
        if self.offload is None:
            return False
        return self.config.offload_admission == "all" or wants_cache(request.sampling_params)

    def _plan_deferred_saves(self, record: StepRecord) -> None:
        """Offload tier: saves deferred at max_pending_saves, planned before this step's forward while
        there is room, if HBM still holds their written checkpoint (pinned until this step is reported,
        so it is not evicted before the save reads it) and every KV block up to it."""
        assert self.offload is not None
        pool = self.kv_cache_manager.pool
        while (deferred := self.offload.next_deferred()) is not None:
            cp, hashes = deferred
            block_ids = [pool.cached_block(h) for h in hashes]
            if not (self._still_filed(cp) and cp.written) or None in block_ids:
                self.offload.drop_deferred()
                continue
            if self.offload.plan_save(hashes, block_ids, cp.num_tokens, cp.unit_ids, before_forward=True):
                cp.pins += 1
                record.pinned.append(cp)

    def _admit_tier_load(self, request: Request, hit: TierHit, hbm_hit_tokens: int, out: _StepBuilder) -> bool:
        """Offload tier: blocks and slots for a joint tier hit (HBM's blocks below hit.start_tokens,
        fresh ones past it) and its load ordered; False (nothing changed) when they do not fit now."""
        assert self.offload is not None and self.prefix_cache is not None
        hashes = self.prefix_cache.block_hashes(request)
        prefix = self.kv_cache_manager.cached_prefix(hashes, hit.start_tokens // self.kv_cache_manager.block_size)
        if not self.kv_cache_manager.can_allocate(request.request_id, hit.num_tokens, prefix):
            return False
        self.waiting.popleft()
        slot = self._allocate_state(request)
        table = self.kv_cache_manager.allocate_slots(request.request_id, hit.num_tokens, prefix)
        assert slot is not None and table is not None
        self.offload.order_load(request.request_id, hit, table, slot, hbm_hit_tokens)
        request.tier_hit_tokens = hit.num_tokens
        request.status = RequestStatus.WAITING_FOR_TIER_LOAD
        self.tier_waiting[request.request_id] = request
        if request.request_id not in self._announced:
            self._announced.add(request.request_id)
            out.new_requests.append(
                NewRequestData(request.request_id, list(request.prompt_token_ids), request.sampling_params))
        return True

    def _finish_tier_loads(self, output: OffloadOutput) -> None:
        """Offload tier: a request whose load every rank finished runs from its hit (the loaded blocks
        become HBM prefix-cache blocks); one whose load failed goes back to waiting, to be admitted
        without the tier."""
        assert self.offload is not None and self.prefix_cache is not None
        done, failed = self.offload.apply(output)
        for request_id in done:
            request = self.tier_waiting.pop(request_id, None)
            if request is None:
                continue  # aborted while loading: freed then
            hit = PrefixHit(request.tier_hit_tokens, [], None, request.tier_hit_tokens)
            self.prefix_cache.account(request, hit)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.kv_cache_manager.commit(request_id, self.prefix_cache.block_hashes(request), hit.num_tokens)
        for request_id in failed:
            request = self.tier_waiting.pop(request_id, None)
            if request is None:
                continue
            self._free(request)
            request.tier_load_failed = True
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

