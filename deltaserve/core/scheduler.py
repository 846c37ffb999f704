"""Continuous batching with chunked prefill under a per-step token budget, FCFS, preemption by recompute.

There are no prefill and decode phases: every request is `num_computed_tokens` chasing `num_tokens`
(prompt plus generated tokens). Each step first serves the running requests in arrival order
(decodes take one token, unfinished prompts take what is left of the budget), then admits waiting
requests while the budget, `max_num_seqs`, the KV blocks and the KDA state slots allow. When a
running request cannot get the blocks it needs, the latest-arrived running request is preempted:
its blocks and state slot are freed and it is recomputed from scratch later, because a KDA state
cannot be rewound.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from deltaserve.core.state_pool import StateSlotPool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, state_pool: StateSlotPool) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.state_pool = state_pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._announced: set[str] = set()
        self._finished_since_last_step: list[str] = []
        self._step_ids = itertools.count()
        self.num_preemptions_total = 0

    # Queries ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # Admission and removal -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already scheduled")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests (abort, or a stop the engine detected) and free everything they hold."""
        if not status.is_finished:
            raise ValueError(f"status={status.name} is not a finished status")
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._free(request)
        del self.requests[request.request_id]
        if request.request_id in self._announced:
            self._announced.discard(request.request_id)
            self._finished_since_last_step.append(request.request_id)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        self.state_pool.free(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # The step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []
        preempted: list[str] = []
        scheduled: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            table = None
            while table is None:
                table = self.kv_cache_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
                if table is None:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
            if table is None:
                break
            chunks.append(self._chunk(request, num_new, table))
            scheduled.add(request.request_id)
            budget -= num_new
            i += 1

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.state_pool.num_free == 0:
                break
            if self.kv_cache_manager.num_blocks_needed(request.request_id, num_new) > (
                self.kv_cache_manager.num_free_blocks
            ):
                break
            self.waiting.popleft()
            slot = self.state_pool.allocate(request.request_id)
            table = self.kv_cache_manager.allocate_slots(request.request_id, num_new)
            assert slot is not None and table is not None
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.request_id not in self._announced:
                self._announced.add(request.request_id)
                new_requests.append(
                    NewRequestData(request.request_id, list(request.prompt_token_ids), request.sampling_params)
                )
            chunks.append(self._chunk(request, num_new, table))
            budget -= num_new

        finished = self._finished_since_last_step
        self._finished_since_last_step = []
        return SchedulerOutput(
            step_id=next(self._step_ids),
            chunks=chunks,
            new_requests=new_requests,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
        )

    def _chunk(self, request: Request, num_new: int, table: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        slot = self.state_pool.slot_of(request.request_id)
        assert slot is not None
        chunk = ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + num_new),
            num_computed_tokens=start,
            block_ids=list(table),
            state_slot=slot,
            sample=start + num_new == request.num_tokens,
            num_output_tokens=request.num_output_tokens,
        )
        request.num_computed_tokens += num_new
        return chunk

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append each sampled token, finish requests that hit a stop condition; the finished requests."""
        finished = []
        for chunk in scheduler_output.chunks:
            if not chunk.sample or chunk.request_id not in sampled:
                continue
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            request.output_token_ids.append(sampled[chunk.request_id])
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return finished
