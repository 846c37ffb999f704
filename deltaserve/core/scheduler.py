"""Continuous batching with chunked prefill under a per-step token budget, FCFS, preemption by recompute.

There are no prefill and decode phases: every request is `num_computed_tokens` chasing `num_tokens`
(prompt plus generated tokens). Each step first serves the running requests in arrival order
(decodes take one token, unfinished prompts take what is left of the budget), then admits waiting
requests while the budget, `max_num_seqs`, the KV blocks and the KDA state slots allow. When a
running request cannot get the blocks it needs, the latest-arrived running request is preempted:
its blocks and state slots are freed and it is recomputed later, because a KDA state cannot be
rewound (with prefix caching it resumes from its latest checkpoint).

With prefix caching (`prefix_cache` given) a request starts from the joint KV + state hit, a chunk
files the checkpoints on its way (the state at its end saved right after it, those inside it captured
by the KDA layers during the same forward pass: `ScheduledChunk.state_captures`), and each
running request holds a second "boundary" slot with its state at the last block boundary it
crossed while decoding, filed as the end-of-sequence checkpoint when it finishes. A request that
still owes prompt logprobs reads no hit: its prompt is computed for the logits at every position.

Several steps may be in flight: `schedule()` may be called again before `update_from_output()` of
the previous step, and outputs are applied in step order. What a step holds until it is reported
(checkpoint pins, the checkpoints it saves, the life of each request it runs) lives in its
`StepRecord`, never on the scheduler. The rule for readers (docs/architecture.md):
- later steps may find a KV block or a checkpoint as soon as the step that writes it is scheduled:
  its blocks are committed and its checkpoints published at the end of `schedule()` (not during
  it, so a request admitted in the same step cannot read what that step writes);
- readers outside the step stream, and checkpoint eviction, wait until the step is reported
  (`Checkpoint.written`).
A request preempted (or finished) while a step that ran it is in flight drops that step's late
sample: each step records the life (`num_preemptions`) of the requests it runs.

A step that samples for a request leaves a placeholder on it (`Request.num_pending_outputs`) until
the step is reported; the next step may decode on it (`PLACEHOLDER_TOKEN_ID`, filled in by the
worker from the id it sampled), unless a length limit can have ended the request or `decode_ahead`
is off (pipeline parallelism: only the last stage holds the sampled id, so a decode waits for its
token while prefill chunks still follow each other into the pipeline). With one step in flight there
is never a placeholder when `schedule()` runs.

Under prefill/decode disaggregation (`kv_connector`, deltaserve/kv_transfer): a producer's request
that finishes for remote decode keeps its blocks and state slots (`held_for_transfer`) until its
consumer releases them or the connector's timeout passes. A consumer's request prefilled remotely
is admitted to blocks and slots for its prompt and waits (`WAITING_FOR_REMOTE_KVS`) while the
worker loads them; then it runs with its prompt computed and the producer's first token appended.

With the offload tier (`offload`, deltaserve/offload/scheduler_side.py) every checkpoint saved on the
chunk grid is also stored in the tier with the KV chunks before it (write-through), and admission
looks past the HBM hit into the tier: a longer joint hit there is loaded while the request waits
(`WAITING_FOR_TIER_LOAD`), then it runs from the hit; a failed load sends it back to waiting, to be
admitted without the tier.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from deltaserve.core.checkpoint_pool import Checkpoint, CheckpointKind
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.prefix_cache import PrefixCache, PrefixHit
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler_invariants import check_scheduler_invariants
from deltaserve.core.scheduler_output import (
    NewRequestData,
    ScheduledChunk,
    SchedulerOutput,
    StateCopy,
    StateLoad,
    StateSave,
)
from deltaserve.core.scheduler_tier import TierScheduling
from deltaserve.core.spec_decode import SpecDecodeScheduling, VerifyWindow, spare_key
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.kv_transfer.metadata import KVConnectorOutput, LoadSpec, RemoteSource
from deltaserve.kv_transfer.scheduler_side import KVConnectorScheduler
from deltaserve.offload.metadata import OffloadOutput
from deltaserve.offload.scheduler_side import OffloadScheduler

NO_HIT = PrefixHit(0, [], None, 0)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    # whether a step may decode on a placeholder (a token still in flight), which the worker fills from
    # the id it sampled; off under pipeline parallelism, where only the last stage holds that id
    decode_ahead: bool = True
    # prefill tokens a step may take while it also decodes (0: up to max_num_batched_tokens): bounds how
    # much a long prompt's chunk slows the running requests' next token
    max_prefill_tokens_with_decodes: int = 0
    # the offload tier saves every request's checkpoints ("all"), or only hinted ones ("cache_control")
    offload_admission: str = "all"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes={self.max_prefill_tokens_with_decodes} must be "
                             ">= 0 (0: no bound beyond max_num_batched_tokens)")


@dataclass
class StepRecord:
    """What one scheduled step holds until the worker reports it."""

    step_id: int
    pinned: list[Checkpoint] = field(default_factory=list)  # loaded by this step
    saved: list[Checkpoint] = field(default_factory=list)  # saved by this step
    lives: dict[str, int] = field(default_factory=dict)  # request id -> num_preemptions when scheduled
    boundaries: dict[str, int] = field(default_factory=dict)  # request id -> boundary its copy sets
    commits: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk end) to commit
    samples: set[str] = field(default_factory=set)  # requests this step samples for (a placeholder each)
    verifies: dict[str, VerifyWindow] = field(default_factory=dict)  # speculative decoding: verify windows


@dataclass
class StepUpdate:
    """What applying one step's output did: the requests it finished, and the requests whose sampled
    token it appended (a late sample of a request preempted, aborted or finished since is not)."""

    finished: list[Request] = field(default_factory=list)
    applied: set[str] = field(default_factory=set)
    # P/D consumer: requests whose load finished this step; their first token (the producer's) is new
    remote_started: list[Request] = field(default_factory=list)
    # speculative decoding: the tokens appended per request, where a verify window appended more than one
    new_tokens: dict[str, list[int]] = field(default_factory=dict)


def boundary_key(request_id: str) -> str:
    """The state-pool owner key of a request's boundary slot."""
    return request_id + "#boundary"


class Scheduler(TierScheduling):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        state_pool: StateSlotPool,
        prefix_cache: PrefixCache | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        offload: OffloadScheduler | None = None,
        spec: SpecDecodeScheduling | None = None,
    ) -> None:
        self.config = config
        self.spec = spec  # speculative decoding: drafts, verify windows, rollback
        self.kv_connector = kv_connector
        if offload is not None and prefix_cache is None:
            raise ValueError("the offload tier stores prefix-cache checkpoints: it needs prefix caching")
        self.offload = offload
        self.tier_waiting: dict[str, Request] = {}  # offload tier: loads in flight
        self.remote_waiting: dict[str, Request] = {}  # consumer: loads in flight
        self._abandoned_loads: dict[str, Request] = {}  # consumer: aborted while loading, freed when it ends
        self.held_for_transfer: dict[str, Request] = {}  # producer: finished, blocks kept for the consumer
        self.kv_cache_manager = kv_cache_manager
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache
        # the live slot, a boundary slot with prefix caching, k spare slots for verify windows
        self.num_spare_slots = spec.k if spec is not None else 0
        self.slots_per_request = (2 if prefix_cache is not None else 1) + self.num_spare_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._announced: set[str] = set()
        self._finished_since_last_step: list[str] = []
        # (checkpoint, its save, (block hashes, block ids) for the offload tier or None)
        self._saves_before_next_step: list[tuple[Checkpoint, StateSave, tuple[list, list] | None]] = []
        self._copies_before_next_step: list[StateCopy] = []  # speculative decoding: state rollbacks
        self._step_ids = itertools.count()
        self.num_preemptions_total = 0
        self.in_flight: OrderedDict[int, StepRecord] = OrderedDict()  # scheduled, not yet reported
        self._sent_blocks: dict[str, int] = {}  # request id -> block ids the workers have, this life

    # Queries ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.remote_waiting or self.tier_waiting)

    @property
    def has_pending_transfers(self) -> bool:
        """P/D: loads in flight or requests held for a consumer: the worker side must keep being polled."""
        return bool(self.remote_waiting or self._abandoned_loads or self.held_for_transfer)

    @property
    def has_pending_saves(self) -> bool:
        """End-of-sequence saves wait for a step to carry them, and offload saves for the ranks' reports:
        run steps even with no requests left."""
        return bool(self._saves_before_next_step) or (self.offload is not None and self.offload.has_pending)

    @property
    def has_unsent_saves(self) -> bool:
        """End-of-sequence saves not yet put on a step."""
        return bool(self._saves_before_next_step)

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
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # its load may still write into its blocks: they are freed when the load ends
                del self.remote_waiting[request_id]
                self._abandoned_loads[request_id] = request
                request.status = status
                del self.requests[request_id]
                self._announce_finished(request_id)
                continue
            elif request.status == RequestStatus.WAITING_FOR_TIER_LOAD:
                # its load runs in a step already scheduled, before any later step can reuse what it frees
                del self.tier_waiting[request_id]
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if status != RequestStatus.FINISHED_ABORTED:
            self._file_end_of_sequence(request)
        request.status = status
        if not self._hold_for_transfer(request, status):
            self._free(request)
        del self.requests[request.request_id]
        self._announce_finished(request.request_id)

    def _announce_finished(self, request_id: str) -> None:
        if request_id in self._announced:
            self._announced.discard(request_id)
            self._finished_since_last_step.append(request_id)

    def _hold_for_transfer(self, request: Request, status: RequestStatus) -> bool:
        """P/D producer: keep a request finished for remote decode (its blocks and slots) for its consumer."""
        if self.kv_connector is None:
            return False
        if status == RequestStatus.FINISHED_ABORTED:
            self.kv_connector.stream_lost(request.request_id, "the request was aborted on the producer")
            return False
        params = self.kv_connector.request_finished(
            request, self.kv_cache_manager.block_ids(request.request_id), self.state_pool.slot_of(request.request_id))
        if params is None:
            return False
        request.kv_transfer_params = params
        self.held_for_transfer[request.request_id] = request
        return True

    def release_transfers(self, released: list[str]) -> int:
        """P/D producer: free the held requests every consumer reader has released, and those no
        consumer read within the connector's timeout. Returns how many were freed."""
        if self.kv_connector is None:
            return 0
        freed = 0
        for request_id in self.kv_connector.released(released) + self.kv_connector.expired():
            request = self.held_for_transfer.pop(request_id, None)
            if request is not None:
                self._free(request)
                freed += 1
        return freed

    def _file_end_of_sequence(self, request: Request) -> None:
        """File the boundary slot's state (the last block boundary decode crossed) as a checkpoint."""
        pc = self.prefix_cache
        if pc is None:
            return
        boundary = request.boundary_num_tokens
        for record in self.in_flight.values():  # a step in flight copies a later state into the slot
            if record.lives.get(request.request_id) == request.num_preemptions:
                boundary = record.boundaries.get(request.request_id, boundary)
        slot = self.state_pool.slot_of(boundary_key(request.request_id))
        if boundary == 0 or boundary > request.num_tokens or slot is None or not self._chain_cached(request, boundary):
            return
        cp = pc.file(request, boundary, CheckpointKind.END_OF_SEQUENCE)
        if cp is not None:
            # saved before anything else in the next step, before any slot can be reused; published
            # when that step is scheduled. The offload tier stores it in that step too, before its forward
            # can overwrite the blocks freed now
            n = boundary // self.kv_cache_manager.block_size
            tier = ((pc.block_hashes(request)[:n], self.kv_cache_manager.block_ids(request.request_id)[:n])
                    if self._offloads(request) else None)
            self._saves_before_next_step.append((cp, StateSave(slot, list(cp.unit_ids)), tier))

    def _chain_cached(self, request: Request, num_tokens: int) -> bool:
        """Whether every KV block of [0, num_tokens) of this request is findable (so a checkpoint at
        num_tokens would be reachable)."""
        assert self.prefix_cache is not None
        hashes = self.prefix_cache.block_hashes(request)
        n = num_tokens // self.kv_cache_manager.block_size
        return 0 < n <= len(hashes) and self.kv_cache_manager.pool.cached_block(hashes[n - 1]) is not None

    def _free(self, request: Request) -> None:
        self._sent_blocks.pop(request.request_id, None)
        self.kv_cache_manager.free(request.request_id)
        self.state_pool.free(request.request_id)
        self.state_pool.free(boundary_key(request.request_id))
        for index in range(1, self.num_spare_slots + 1):
            self.state_pool.free(spare_key(request.request_id, index))
        request.boundary_num_tokens = 0

    def _allocate_state(self, request: Request) -> int:
        """The request's live slot, its boundary slot (prefix caching) and its spare slots (speculative
        decoding); the caller checked that slots_per_request are free."""
        slot = self.state_pool.allocate(request.request_id)
        assert slot is not None
        if self.prefix_cache is not None:
            self.state_pool.allocate(boundary_key(request.request_id))
        for index in range(1, self.num_spare_slots + 1):
            self.state_pool.allocate(spare_key(request.request_id, index))
        return slot

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        if self.kv_connector is not None:  # chunked transfer: its consumer may have read from the blocks freed
            self.kv_connector.stream_lost(request.request_id, "the producer preempted the request mid-prefill")
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_outputs = 0  # the steps in flight are of its earlier life: their samples are dropped
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # The step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        record = StepRecord(next(self._step_ids))
        out = _StepBuilder()
        copies_before, self._copies_before_next_step = self._copies_before_next_step, []
        for cp, save, tier in self._saves_before_next_step:
            if self._still_filed(cp):  # this step saves it first thing: from now on later loads may find it
                out.saves_before.append(save)
                record.saved.append(cp)
                self.prefix_cache.checkpoints.publish(cp.block_hash)
                if tier is not None and self.offload is not None:
                    self.offload.plan_save(*tier, cp.num_tokens, cp.unit_ids, before_forward=True, checkpoint=cp)
        self._saves_before_next_step = []
        if self.offload is not None:
            self._plan_deferred_saves(record)

        # prefill tokens this step may still take (a bound only while some running request decodes)
        prefill_left = budget
        if self.config.max_prefill_tokens_with_decodes and any(
                r.num_tokens_with_pending - r.num_computed_tokens == 1 for r in self.running):
            prefill_left = self.config.max_prefill_tokens_with_decodes
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending_outputs and not (
                self.config.decode_ahead and request.may_run_ahead(self.config.max_model_len)
            ):
                i += 1
                continue
            drafts = self._drafts(request, budget)
            if drafts:
                num_new, kind, captures = 1 + len(drafts), None, []  # nothing is filed inside a verify window
            else:
                is_prefill = request.num_tokens_with_pending - request.num_computed_tokens > 1
                num_new, kind, captures = self._chunk_length(request, request.num_computed_tokens,
                                                             min(budget, prefill_left) if is_prefill else budget)
                prefill_left -= num_new if is_prefill else 0
            if num_new <= 0:
                i += 1
                continue
            table = None
            while table is None:
                table = self.kv_cache_manager.allocate_slots(
                    request.request_id, self._with_lookahead(request.num_computed_tokens + num_new))
                if table is None:
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim.request_id)
                    if victim is request:
                        break
            if table is None:
                break
            num_new = self._schedule_chunk(request, num_new, table, out, kind, record, drafts, captures)
            budget -= num_new
            i += 1

        while (self.waiting and min(budget, prefill_left) > 0 and not out.preempted
               and len(self.running) + len(self.remote_waiting) + len(self.tier_waiting) < self.config.max_num_seqs):
            request = self.waiting[0]
            if self.state_pool.num_free < self.slots_per_request:
                break
            if self.kv_connector is not None and not request.remote_load_failed and request.remote_source is not None:
                if not self._admit_remote(request, out):
                    break
                continue
            # a request that owes prompt logprobs computes its prompt (as vLLM's skip_reading_prefix_cache);
            # what it computes is still committed for others
            reads_cache = self.prefix_cache is not None and not request.skip_reading_prefix_cache
            hit = self.prefix_cache.lookup(request) if reads_cache else NO_HIT
            if reads_cache and self.offload is not None and not request.tier_load_failed:
                tier_hit = self.offload.lookup(self.prefix_cache.block_hashes(request), request.num_tokens,
                                               hit.num_kv_hit_tokens, hit.num_tokens)
                if tier_hit is not None:
                    if not self._admit_tier_load(request, tier_hit, hit.num_tokens, out):
                        break
                    continue
            num_new, kind, captures = self._chunk_length(request, hit.num_tokens, min(budget, prefill_left))
            reserve = self._readmission_reserve(request)
            if not self.kv_cache_manager.can_allocate(request.request_id,
                                                      self._with_lookahead(hit.num_tokens + num_new) + reserve,
                                                      hit.block_ids):
                break
            self.waiting.popleft()
            slot = self._allocate_state(request)
            table = self.kv_cache_manager.allocate_slots(request.request_id,
                                                         self._with_lookahead(hit.num_tokens + num_new), hit.block_ids)
            assert slot is not None and table is not None
            if reads_cache:
                self.prefix_cache.account(request, hit)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            if hit.checkpoint is not None:
                hit.checkpoint.pins += 1
                record.pinned.append(hit.checkpoint)
                out.loads.append(StateLoad(list(hit.checkpoint.unit_ids), slot))
                request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.request_id not in self._announced:
                self._announced.add(request.request_id)
                out.new_requests.append(
                    NewRequestData(request.request_id, list(request.prompt_token_ids), request.sampling_params)
                )
            num_new = self._schedule_chunk(request, num_new, table, out, kind, record, captures=captures)
            budget -= num_new
            prefill_left -= num_new

        self._commit_and_publish(record, out)
        self.in_flight[record.step_id] = record
        meta = self.kv_connector.build_meta() if self.kv_connector is not None else None
        offload_meta = self.offload.build_meta() if self.offload is not None else None
        finished = self._finished_since_last_step
        self._finished_since_last_step = []
        return SchedulerOutput(
            step_id=record.step_id,
            chunks=out.chunks,
            new_requests=out.new_requests,
            finished_request_ids=finished,
            preempted_request_ids=out.preempted,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            state_copies_before=copies_before,
            state_saves_before=out.saves_before,
            state_loads=out.loads,
            state_saves_after=out.saves_after,
            state_copies_after=out.copies_after,
            kv_connector_metadata=meta,
            poll_kv_connector=self.has_pending_transfers,
            offload_metadata=offload_meta,
            poll_offload=self.offload is not None and self.offload.has_pending,
        )

    def _admit_remote(self, request: Request, out: _StepBuilder) -> bool:
        """P/D consumer: blocks and slots for a remotely prefilled prompt, and its load ordered; False
        (nothing changed) when they do not fit now."""
        n = request.num_prompt_tokens
        if not self.kv_cache_manager.can_allocate(request.request_id, n + 1, []):
            return False
        self.waiting.popleft()
        slot = self._allocate_state(request)
        table = self.kv_cache_manager.allocate_slots(request.request_id, n, [])
        assert slot is not None and table is not None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.remote_waiting[request.request_id] = request
        assert self.kv_connector is not None
        self.kv_connector.add_load(LoadSpec(request.request_id, list(table), slot, request.remote_source))
        if request.request_id not in self._announced:
            self._announced.add(request.request_id)
            out.new_requests.append(
                NewRequestData(request.request_id, list(request.prompt_token_ids), request.sampling_params))
        return True

    def _finish_loads(self, kv_output: KVConnectorOutput, update: StepUpdate) -> None:
        """P/D consumer: a finished load makes its request run (its prompt computed, the producer's
        first token appended); a failed one recomputes the prompt here or fails the request, by
        kv_load_failure_policy."""
        assert self.kv_connector is not None
        for request_id in kv_output.finished_recving + list(kv_output.failed_recving):
            abandoned = self._abandoned_loads.pop(request_id, None)
            if abandoned is not None:
                self._free(abandoned)
        for request_id in kv_output.finished_recving:
            request = self.remote_waiting.pop(request_id, None)
            if request is None:
                continue
            request.num_computed_tokens = request.num_prompt_tokens
            final = kv_output.remote_params.get(request_id)
            if final is not None:  # chunked transfer: the first token was learnt with the last part
                request.remote_source = RemoteSource.from_params(final)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = 0
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            update.remote_started.append(request)
            self._append_token(request, request.remote_source.first_token_id, update)
        for request_id, reason in kv_output.failed_recving.items():
            request = self.remote_waiting.pop(request_id, None)
            if request is None:
                continue
            self._free(request)
            refused = request_id in kv_output.refused  # the layouts cannot pair: recomputing hides that
            if self.kv_connector.config.kv_load_failure_policy == "recompute" and not refused:
                request.remote_load_failed = True
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
            else:
                request.stop_reason = f"kv transfer refused: {reason}" if refused else f"kv load failed: {reason}"
                request.status = RequestStatus.FINISHED_ABORTED
                del self.requests[request_id]
                self._announce_finished(request_id)
                update.finished.append(request)

    def _still_filed(self, cp: Checkpoint) -> bool:
        assert self.prefix_cache is not None
        return self.prefix_cache.checkpoints.get(cp.block_hash) is cp

    def _chunk_length(self, request: Request, start: int, budget: int,
                      ) -> tuple[int, CheckpointKind | None, list[tuple[int, CheckpointKind]]]:
        """Tokens to compute from `start` (what is left, within the budget), the kind of checkpoint to
        file at the chunk's end, and the checkpoints to capture inside it: (grid point, kind) each, their
        images taken during the same forward pass (`ScheduledChunk.state_captures`), so a checkpoint
        never costs a pass of its own."""
        end = start + min(request.num_tokens_with_pending - start, budget)
        if self.prefix_cache is None or end <= start:
            return end - start, None, []
        points = self.prefix_cache.boundaries(request, start, end)
        if points and points[-1][0] == end:
            return end - start, points[-1][1], points[:-1]
        return end - start, None, points

    def _readmission_reserve(self, request: Request) -> int:
        """Hysteresis for a preempted request: it comes back only with a block to spare for every
        running request, so the next steps' decodes do not preempt it again at once."""
        if request.num_preemptions == 0:
            return 0
        return len(self.running) * self.kv_cache_manager.block_size

    def _with_lookahead(self, num_tokens: int) -> int:
        """Tokens to hold KV blocks for: a model drafter writes its drafts' latents past the chunk."""
        lookahead = self.spec.lookahead if self.spec is not None else 0
        return min(num_tokens + lookahead, max(num_tokens, self.config.max_model_len))

    def _fit_captures(self, captures: list[tuple[int, CheckpointKind]], start: int, num_new: int,
                      kind: CheckpointKind | None,
                      ) -> tuple[list[tuple[int, CheckpointKind]], int, CheckpointKind | None]:
        """The captures, chunk length and end kind that file no more checkpoints than the pool can take
        now: past that, the chunk ends at the last point that fits (filed at its end as a chunk cut there
        always was), and the next step goes on. The offload tier's bound on saves in flight cuts no
        chunk: saves past it are deferred (offload/scheduler_side.py). Cutting chunks to that bound took
        the same hits in `bench cache-sim` and doubled the median steps to a first token (NOTES,
        2026-12-07)."""
        assert self.prefix_cache is not None
        points = captures + ([(start + num_new, kind)] if kind is not None else [])
        room = self.prefix_cache.checkpoints.num_fileable
        if len(points) <= room:
            return captures, num_new, kind
        last, last_kind = points[max(room, 1) - 1]
        return points[: max(room, 1) - 1], last - start, last_kind

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Speculative decoding: drafts for a request ready to decode (all but its last token computed,
        no step in flight for it); [] when it decodes plainly."""
        if (self.spec is None or request.num_pending_outputs
                or request.num_computed_tokens != request.num_tokens - 1 or request.num_output_tokens == 0):
            return []
        return self.spec.drafts(request, budget, self.config.max_model_len)

    def _verify_window(self, request: Request, start: int, num_drafts: int) -> VerifyWindow:
        spares = [self.state_pool.slot_of(spare_key(request.request_id, i)) for i in range(1, num_drafts + 1)]
        slots = (self.state_pool.slot_of(request.request_id), *spares)
        assert None not in slots
        return VerifyWindow(start, slots, self.state_pool.slot_of(boundary_key(request.request_id)))

    def _schedule_chunk(
        self, request: Request, num_new: int, table: list[int], out: _StepBuilder, kind: CheckpointKind | None,
        record: StepRecord, drafts: list[int] | None = None, captures: list[tuple[int, CheckpointKind]] = (),
    ) -> int:
        """Put tokens [computed, computed + num_new) of the request on the step; with drafts, its verify
        window (the last known token, then the drafts); with captures, the checkpoints it files inside.
        Returns the tokens scheduled (fewer than num_new where the checkpoints to file do not fit now)."""
        start = request.num_computed_tokens
        slot = self.state_pool.slot_of(request.request_id)
        assert slot is not None
        sent = self._sent_blocks.get(request.request_id)
        self._sent_blocks[request.request_id] = len(table)
        window = self._verify_window(request, start, len(drafts)) if drafts else None
        state_captures = []
        if captures:
            captures, num_new, kind = self._fit_captures(captures, start, num_new, kind)
        for point, point_kind in captures:
            assert self.prefix_cache is not None
            cp = self.prefix_cache.file(request, point, point_kind)
            if cp is not None:
                state_captures.append((point - start, tuple(cp.unit_ids)))
                out.filed.append((cp, request))
        end = start + num_new
        out.chunks.append(
            ScheduledChunk(
                request_id=request.request_id,
                token_ids=request.token_slice(start, start + 1) + drafts if drafts else request.token_slice(start, end),
                num_computed_tokens=start,
                new_block_ids=table[sent or 0:],
                table_reset=sent is None,
                state_slot=slot,
                sample=end == request.num_tokens_with_pending or window is not None,
                num_output_tokens=request.num_output_tokens + request.num_pending_outputs,
                prompt_logprob_targets=request.take_prompt_logprob_targets(start, end),
                verify_state_slots=window.slots if window is not None else (),
                state_captures=tuple(state_captures),
            )
        )
        if end == request.num_tokens_with_pending or window is not None:
            request.num_pending_outputs += 1
            record.samples.add(request.request_id)
        request.num_computed_tokens = end  # a verify window's is set again by its accept count
        record.lives[request.request_id] = request.num_preemptions
        if window is not None:
            record.verifies[request.request_id] = window
        pc = self.prefix_cache
        if pc is None:
            return num_new
        record.commits.append((request, start + 1 if window is not None else end))  # drafts are never committed
        if window is not None or end % pc.grid:
            return num_new
        if kind is not None:
            cp = pc.file(request, end, kind)
            if cp is not None:
                out.saves_after.append(StateSave(slot, list(cp.unit_ids)))
                out.filed.append((cp, request))
        if end > request.num_prompt_tokens:
            boundary_slot = self.state_pool.slot_of(boundary_key(request.request_id))
            assert boundary_slot is not None
            out.copies_after.append(StateCopy(slot, boundary_slot))
            record.boundaries[request.request_id] = end
        return num_new

    def _commit_and_publish(self, record: StepRecord, out: _StepBuilder) -> None:
        """End of schedule(): this step's blocks become findable (committed up to each chunk's own end)
        and its checkpoints too, for later steps. A checkpoint whose blocks could not be committed
        could never be found: it is dropped with its save."""
        pc = self.prefix_cache
        if pc is None:
            return
        for request, end in record.commits:
            if request.status == RequestStatus.RUNNING:
                self.kv_cache_manager.commit(request.request_id, pc.block_hashes(request), end)
        for cp, request in out.filed:
            if self.kv_cache_manager.pool.cached_block(cp.block_hash) is None:
                out.saves_after = [save for save in out.saves_after if save.unit_ids != cp.unit_ids]
                pc.checkpoints.free(cp.block_hash)
                continue
            pc.checkpoints.publish(cp.block_hash)
            record.saved.append(cp)
            if self._offloads(request):  # write-through: the tier stores it after this step's saves_after
                self.offload.plan_save(pc.block_hashes(request), self.kv_cache_manager.block_ids(request.request_id),
                                       cp.num_tokens, cp.unit_ids, before_forward=False, checkpoint=cp)

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int],
                           kv_output: KVConnectorOutput | None = None,
                           offload_output: OffloadOutput | None = None,
                           extra_tokens: dict[str, list[int]] | None = None,
                           draft_tokens: dict[str, list[int]] | None = None) -> StepUpdate:
        """After the step ran (steps are reported in the order they were scheduled): unpin what it
        loaded, mark what it saved written, append each sampled token of a request still in the life
        it was scheduled in, and finish requests that hit a stop condition. A verify window's further
        accepted tokens come in `extra_tokens` (after its first, in `sampled`); its state rollback goes
        on the next step. A model drafter's proposals for the next step come in `draft_tokens`."""
        oldest = next(iter(self.in_flight), None)
        if oldest != scheduler_output.step_id:
            raise ValueError(f"step {scheduler_output.step_id} reported, but the oldest step in flight is {oldest}")
        record = self.in_flight.pop(oldest)
        pc = self.prefix_cache
        if pc is not None:
            for cp in record.pinned:
                cp.pins -= 1
            for cp in record.saved:
                pc.checkpoints.mark_written(cp.block_hash, cp)
        for request_id, boundary in record.boundaries.items():
            request = self.requests.get(request_id)
            if request is not None and request.num_preemptions == record.lives.get(request_id):
                request.boundary_num_tokens = boundary

        update = StepUpdate()
        if kv_output is not None and self.kv_connector is not None:
            self._finish_loads(kv_output, update)
        if offload_output is not None and self.offload is not None:
            self._finish_tier_loads(offload_output)
        for chunk in scheduler_output.chunks:
            if not chunk.sample or chunk.request_id not in sampled:
                continue
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            if request.num_preemptions != record.lives.get(chunk.request_id):
                continue  # a late output of the request's life before a preemption
            request.num_pending_outputs -= 1
            tokens = [sampled[chunk.request_id]]
            window = record.verifies.get(chunk.request_id)
            if window is not None:
                assert self.spec is not None
                tokens += (extra_tokens or {}).get(chunk.request_id, [])
                self._copies_before_next_step += self.spec.rollback(request, window, len(tokens))
                update.new_tokens[chunk.request_id] = appended = []
            update.applied.add(chunk.request_id)
            request.spec_token_ids = (draft_tokens or {}).get(chunk.request_id, [])
            for token in tokens:
                if window is not None:
                    appended.append(token)
                if self._append_token(request, token, update):
                    break
        return update

    def _append_token(self, request: Request, token: int, update: StepUpdate) -> bool:
        """Append a running request's next token, commit the blocks it completed (their hashes are known
        now) and finish the request if the token stops it; returns whether it did."""
        request.output_token_ids.append(token)
        if self.prefix_cache is not None:
            self.kv_cache_manager.commit(request.request_id, self.prefix_cache.block_hashes(request),
                                         request.num_computed_tokens)
        status = request.check_stop(self.config.max_model_len)
        if status is None:
            return False
        self.running.remove(request)
        self._finish(request, status)
        update.finished.append(request)
        return True

    # Invariants ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless every KV block, state slot, checkpoint unit and pin is
        accounted for: the tests and the fuzzer call this after every step."""
        check_scheduler_invariants(self)


class _StepBuilder:
    """The lists one schedule() call fills."""

    def __init__(self) -> None:
        self.chunks: list[ScheduledChunk] = []
        self.new_requests: list[NewRequestData] = []
        self.preempted: list[str] = []
        self.saves_before: list[StateSave] = []
        self.loads: list[StateLoad] = []
        self.saves_after: list[StateSave] = []
        self.copies_after: list[StateCopy] = []
        self.filed: list[tuple[Checkpoint, Request]] = []  # checkpoints that saves_after writes, with their requests
