"""The engine core: scheduler, caches and executor, stepping on token ids only.

It never sees text. Requests arrive tokenized and validated (`EngineCoreRequest`); each step returns
the new token ids and logprobs of every request that sampled, and the new prompt logprobs of every
request that computed some (`EngineCoreOutput`), plus plain numbers for metrics (`IterationStats`).
Detokenization and stop strings live in the output processor, in the offline `LLMEngine` or in each
API front-end process, so the loop here never waits on a tokenizer. Everything that crosses this
boundary is a plain dataclass that pickles.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan, default_checkpoint_interval
from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler import Scheduler, SchedulerConfig, StepUpdate
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.core.spec_decode import SpecDecodeScheduling, spec_decode_metrics
from deltaserve.core.stage_specs import model_wide_specs, plan_stage_caches
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.kv_transfer.engine_side import KVTransferEngineSide
from deltaserve.offload.scheduler_side import OffloadScheduler, tier_index_for
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec.ngram_proposer import NgramProposer
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput, StepPromptLogprobs, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request. `max_tokens` is resolved (never None)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.time)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request.

    finish_reason: None while running, else "stop" / "length" (set by the core) or "abort".
    stop_reason: the stop token id that ended it, if any.
    new_prompt_logprobs: the prompt logprobs the step computed (requests with prompt_logprobs); an
        output with these and no new token comes from a prefill chunk that did not sample.
    kv_transfer_params: on a P/D producer's finished output, what its consumer needs (kv_transfer/);
        under chunked transfer also on an output without tokens, given when the request is added.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: StepPromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int


@dataclass
class IterationStats:
    """Plain numbers from one step, for Prometheus and the periodic log line."""

    num_prompt_tokens: int = 0  # prompt tokens of requests that produced their first token this step
    num_generation_tokens: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _Timing:
    arrival_time: float
    first_scheduled_time: float | None = None
    last_token_time: float | None = None


class EngineCore:
    """One scheduler, one executor, the KV cache, the state pool and the prefix cache."""

    def __init__(self, config: EngineConfig, model_dir: str, model_config: KimiLinearConfig,
                 max_model_len: int, eos_token_ids: Iterable[int], model: Any = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._arrivals = itertools.count()
        # refused here, before any rank starts, when the experts do not split evenly over the TP ranks
        expert_placement = config.parallel.describe_expert_placement(model_config.num_experts)
        from deltaserve.executor.base import executor_class  # torch and the model: only where the core runs

        self.executor = executor_class(config.executor_backend)(config, model_config, model_dir, model)
        self.kv_transfer: KVTransferEngineSide | None = None
        try:
            self._plan_caches(config, max_model_len)
            max_model_len = self._cap_to_the_cache(config, max_model_len)
            if config.kv_transfer_config is not None:
                self.kv_transfer = KVTransferEngineSide.start(
                    config.kv_transfer_config, self.executor.kv_layouts(), config.scheduler_block_size,
                    config.parallel.decode_context_parallel_size)
            self._build_scheduler(config, max_model_len)
        except BaseException:
            if self.kv_transfer is not None:
                self.kv_transfer.close()
            self.executor.shutdown()
            raise
        self._timings: dict[str, _Timing] = {}
        self.offload_rank_stats: dict[int, dict] = {}  # offload tier: each rank's latest counters
        self._num_computed_tokens = 0
        self.async_scheduling = config.resolve_async_scheduling(self.executor.device_type)
        # steps scheduled and handed to the executor, oldest first: async scheduling keeps two in flight,
        # a pipeline up to pp_max_inflight batches (0: one per stage)
        self.pipelined = config.pipeline_parallel_size > 1
        if self.pipelined:
            self.batch_queue_size = config.batches_in_flight
        else:
            self.batch_queue_size = 2 if self.async_scheduling else 1
        self._batch_queue: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput]] = deque()
        self._early_outputs: list[EngineCoreOutput] = []  # chunked transfer's params of requests just added
        self._max_batches_in_flight = 0
        logger.info(
            "deltaserve engine: model=%s dtype=%s device=%s executor=%s tp=%d pp=%d dcp=%d %s kv_blocks=%d "
            "(block_size %d, %d tokens of context) state_slots=%d checkpoint_units=%d x %d bytes prefix_caching=%s "
            "async_scheduling=%s batches_in_flight=%d",
            model_dir, self.executor.dtype_name, self.executor.device_name, config.executor_backend,
            config.tensor_parallel_size, config.pipeline_parallel_size, config.decode_context_parallel_size,
            expert_placement, self.cache_plan.num_blocks, config.scheduler_block_size,
            self.cache_plan.num_blocks * config.scheduler_block_size, self.cache_plan.num_state_slots,
            self.cache_plan.num_checkpoint_units, self.cache_plan.checkpoint_unit_bytes, config.enable_prefix_caching,
            self.async_scheduling, self.batch_queue_size,
        )

    def _build_scheduler(self, config: EngineConfig, max_model_len: int) -> None:
        """The KV manager, the prefix cache and the scheduler over the planned caches."""
        kv_spec, state_spec = self.model_kv_spec, self.model_state_spec
        caching = config.enable_prefix_caching
        slots_per_seq = self._slots_per_seq(config)
        kv_manager = KVCacheManager(kv_spec, self.cache_plan.num_blocks, enable_prefix_caching=caching)
        self.prefix_cache: PrefixCache | None = None
        if caching:
            interval = config.state_checkpoint_interval or default_checkpoint_interval(kv_spec, state_spec,
                                                                                       config.checkpoint_grid)
            # under PP a checkpoint takes the same unit ids on every stage: as many as the largest needs
            image_bytes = max(st.bytes_per_image for _, st in self.stage_specs)
            units = CheckpointPool(
                self.cache_plan.num_checkpoint_units,
                max(self.cache_plan.checkpoint_unit_bytes, 1),
                image_bytes,
            )
            if units.capacity < 1:
                raise ValueError(
                    f"prefix caching needs room for at least one KDA state checkpoint "
                    f"({image_bytes} bytes), but state_checkpoint_fraction="
                    f"{config.state_checkpoint_fraction} leaves {self.cache_plan.num_checkpoint_units} units of "
                    f"{self.cache_plan.checkpoint_unit_bytes} bytes: raise state_checkpoint_fraction "
                    f"(--state-checkpoint-fraction) or the cache budget, or turn prefix caching off "
                    f"(--no-enable-prefix-caching)"
                )
            chunk = config.kv_offloading_chunk_size if config.offloading_enabled else 1
            self.prefix_cache = PrefixCache(kv_manager, units, interval, offload_chunk=chunk)
        self.offload: OffloadScheduler | None = None
        if config.offloading_enabled:
            self.offload = OffloadScheduler(tier_index_for(config, self.stage_specs),
                                            config.offloading_max_pending_saves)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=min(config.max_num_seqs, self.cache_plan.num_state_slots // slots_per_seq),
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
                offload_admission=config.kv_offloading_admission,
                # only the last stage knows a sampled token: under PP a decode waits for it; so does a
                # verify window, for the tokens the previous one accepted
                decode_ahead=config.pipeline_parallel_size == 1 and config.speculative_config is None,
            ),
            kv_manager,
            StateSlotPool(self.cache_plan.num_state_slots),
            self.prefix_cache,
            self.kv_transfer.scheduler if self.kv_transfer is not None else None,
            self.offload,
            self._spec_scheduling(config),
        )

    @staticmethod
    def _slots_per_seq(config: EngineConfig) -> int:
        """State slots a running request holds: its live slot, a boundary slot with prefix caching (the
        state at the last block boundary decode crossed), k spares with speculative decoding."""
        return (2 if config.enable_prefix_caching else 1) + config.num_speculative_tokens

    def _spec_scheduling(self, config: EngineConfig) -> SpecDecodeScheduling | None:
        """Speculative decoding's scheduler side, or None (off, or a P/D producer)."""
        spec = config.speculative_config
        if config.num_speculative_tokens == 0:
            return None
        grid = self.prefix_cache.grid if self.prefix_cache is not None else None
        if spec.method == "ngram":
            ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
            return SpecDecodeScheduling(spec.num_speculative_tokens,
                                        ngram.propose_for, grid)
        # a model drafter proposes on the output rank after each step; its latents need k tokens of lookahead
        return SpecDecodeScheduling(spec.num_speculative_tokens, lambda request, n: request.spec_token_ids[:n], grid,
                                    lookahead=spec.num_speculative_tokens)

    def _cap_to_the_cache(self, config: EngineConfig, max_model_len: int) -> int:
        """max_model_len, lowered to what the whole KV cache holds when num_kv_blocks leaves less (as
        vLLM caps it): a sequence that can never fit would otherwise wait, or preempt itself, forever."""
        capacity = self.cache_plan.num_blocks * config.scheduler_block_size
        if capacity >= max_model_len:
            return max_model_len
        logger.warning("num_kv_blocks=%d holds %d tokens: max_model_len lowered from %d to %d",
                       self.cache_plan.num_blocks, capacity, max_model_len, capacity)
        self.max_model_len = capacity
        return capacity

    def _plan_caches(self, config: EngineConfig, max_model_len: int) -> None:
        """The cache plan every pipeline stage can hold, allocated on every rank, and the joint KDA
        checkpoint spec the stages agreed on (None without checkpoints)."""
        caching = config.enable_prefix_caching
        self.stage_specs = self.executor.stage_cache_specs()
        self.model_kv_spec, self.model_state_spec = model_wide_specs(self.stage_specs)
        plan, joint = plan_stage_caches(
            self.executor.stage_cache_bytes(), self.stage_specs, config.max_num_seqs, max_model_len,
            slots_per_seq=self._slots_per_seq(config),
            checkpoint_fraction=config.state_checkpoint_fraction if caching else 0.0,
            checkpoint_unit_bytes=config.state_checkpoint_unit_bytes,
        )
        if config.num_kv_blocks is not None:
            plan = dataclasses.replace(plan, num_blocks=config.num_kv_blocks)
        self.cache_plan: CachePlan = plan
        self.checkpoint_spec = joint
        self.executor.initialize_cache(plan, joint)

    # Requests --------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError, changing nothing, if the id is taken or it cannot fit."""
        if req.request_id in self._timings:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        if not req.prompt_token_ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        if len(req.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(req.prompt_token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        params = req.params
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            arrival_index=next(self._arrivals),
            sampling_params=params,
            prompt_logprobs=params.prompt_logprobs is not None,
        )
        if self.kv_transfer is not None:  # a P/D consumer's request names where its prompt was prefilled
            request.remote_source = self.kv_transfer.scheduler.remote_source(params, request.num_prompt_tokens)
        self.scheduler.add_request(request)
        self._timings[req.request_id] = _Timing(req.arrival_time)
        early = self.kv_transfer.scheduler.stream_started(request) if self.kv_transfer is not None else None
        if early is not None:  # chunked transfer: the consumer may start reading while the prefill runs
            self._early_outputs.append(EngineCoreOutput(req.request_id, [], kv_transfer_params=early))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        ) -> None:
        """End requests now (an abort, or a stop string the output processor found) and free their
        blocks, state slots and checkpoint pins. Unknown or finished ids are ignored."""
        ids = list(request_ids)
        self.scheduler.finish_requests(ids, status)
        for request_id in ids:
            self._timings.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Requests left, end-of-sequence checkpoint saves that still need a step to run them, or
        steps in flight."""
        return self._has_work_to_schedule() or bool(self._batch_queue)

    def waiting_only_on_transfers(self) -> bool:
        """Every unfinished request waits for its KV to arrive (a P/D consumer's load, an offload tier
        load reported by some ranks only) or only offload saves are still to be reported, and no step is
        in flight: a step then only polls the ranks, so the loop may pause between them."""
        s = self.scheduler
        transfers = bool(s.remote_waiting or s.tier_waiting) or (s.offload is not None and s.offload.has_pending)
        return transfers and not s.running and not s.waiting and not s.has_unsent_saves and not self._batch_queue

    def _has_work_to_schedule(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_saves

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    # The loop --------------------------------------------------------------------------------
    def step(self) -> tuple[list[EngineCoreOutput], IterationStats]:
        """One turn of the loop: schedule a step if the batch queue has room, then, unless there is
        room for another one, wait for the oldest step and apply its sampled tokens.

        With one step in flight (synchronous scheduling) every call schedules, runs and applies one
        step. With async scheduling the next step is scheduled and queued before the oldest is
        waited for, so the host's work overlaps the device's. Returns one output per request that
        sampled in the applied step (none when no step was applied), and the turn's statistics; a
        P/D producer under chunked transfer first gives the kv_transfer_params of requests added
        since the last turn (outputs without tokens).
        """
        early, self._early_outputs = self._early_outputs, []
        outputs, stats = self._step()
        return early + outputs, stats

    def _step(self) -> tuple[list[EngineCoreOutput], IterationStats]:
        stats = IterationStats()
        self.poll_transfers()
        queue = self._batch_queue
        if len(queue) < self.batch_queue_size and self._has_work_to_schedule():
            scheduler_output = self.scheduler.schedule()
            queue.append((scheduler_output, self._launch(scheduler_output, stats)))
            if not scheduler_output.is_empty:
                in_flight = sum(not so.is_empty for so, _ in queue)
                self._max_batches_in_flight = max(self._max_batches_in_flight, in_flight)
            if len(queue) < self.batch_queue_size and not scheduler_output.is_empty:
                return [], stats  # room for one more step before waiting on this one
        if not queue:
            return [], stats
        scheduler_output, handle = queue.popleft()
        return self._apply(scheduler_output, handle.get_output(), stats), stats

    def poll_transfers(self) -> None:
        """P/D producer: free the requests its consumers have read (or that timed out). Cheap; the
        server's loop also calls it while idle, so held requests are freed without a step."""
        if self.kv_transfer is not None:
            self.scheduler.release_transfers(self.kv_transfer.drain_released())
            self.kv_transfer.drop_stale_releases()

    def _launch(self, scheduler_output: SchedulerOutput, stats: IterationStats) -> AsyncModelRunnerOutput:
        if scheduler_output.is_empty:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput())  # nothing to run: only its record to close
        now = time.time()
        for new in scheduler_output.new_requests:
            timing = self._timings.get(new.request_id)
            if timing is not None and timing.first_scheduled_time is None:
                timing.first_scheduled_time = now
        stats.num_computed_tokens = scheduler_output.num_scheduled_tokens
        self._num_computed_tokens += stats.num_computed_tokens
        if not (self.async_scheduling or self.pipelined):
            return AsyncModelRunnerOutput.ready(self.executor.execute_model(scheduler_output))
        return self.executor.execute_model(scheduler_output, non_block=True)

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
               stats: IterationStats) -> list[EngineCoreOutput]:
        if self.kv_transfer is not None and runner_output.kv_connector_output is not None:
            self.kv_transfer.note_output(runner_output.kv_connector_output)
        if runner_output.offload_output is not None and runner_output.offload_output.stats:
            self.offload_rank_stats.update(runner_output.offload_output.stats)
        update = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_by_request(),
                                                   runner_output.kv_connector_output, runner_output.offload_output,
                                                   runner_output.extra_token_ids, runner_output.draft_token_ids)
        finished = {r.request_id: r for r in update.finished}
        if self.kv_transfer is not None and self.kv_transfer.scheduler.streams:
            self._publish_progress(scheduler_output)
        prompt_logprobs = dict(runner_output.prompt_logprobs)
        now = time.time()
        outputs = []
        for request_id, token_id, lp in zip(
            runner_output.request_ids, runner_output.sampled_token_ids, runner_output.logprobs, strict=True
        ):
            timing = self._timings.get(request_id)
            if timing is None or request_id not in update.applied:
                continue  # aborted while the step ran, or a late sample of a request preempted since
            request = finished.get(request_id) or self.scheduler.get_request(request_id)
            if request is None:
                continue
            new_token_ids = update.new_tokens.get(request_id, [token_id])
            self._record_token(stats, request, timing, now, len(new_token_ids))
            out = EngineCoreOutput(
                request_id, new_token_ids, [lp] if lp is not None else None, prompt_logprobs.pop(request_id, None),
                num_cached_tokens=request.num_cached_tokens or 0,
            )
            if request_id in finished:
                out.finish_reason = request.finish_reason
                out.stop_reason = request.stop_reason
                out.kv_transfer_params = request.kv_transfer_params
                if out.kv_transfer_params is not None and lp is not None:  # P/D: the consumer reports them
                    out.kv_transfer_params["first_token_logprobs"] = [lp.token_ids, lp.logprobs, lp.rank]
                if out.kv_transfer_params is not None and self.kv_transfer is not None:
                    self.kv_transfer.scheduler.stream_done(request_id, dict(out.kv_transfer_params))
                stats.finished.append(self._finished_stats(request, timing, now))
                del self._timings[request_id]
            outputs.append(out)
        outputs += self._remote_outputs(update, finished, stats, now)
        for request_id, plp in prompt_logprobs.items():
            # a chunk that did not sample, or whose sample was dropped: the request preempted since
            # still keeps these, which were computed right and are never scheduled again
            request = self.scheduler.get_request(request_id)
            if request is not None and request_id in self._timings:
                outputs.append(EngineCoreOutput(request_id, [], new_prompt_logprobs=plp,
                                                num_cached_tokens=request.num_cached_tokens or 0))
        return outputs

    def _publish_progress(self, scheduler_output: SchedulerOutput) -> None:
        """Chunked transfer: the prompt tokens this completed step computed become readable (the
        step's output came back, so every stage has written them)."""
        connector = self.kv_transfer.scheduler
        for chunk in scheduler_output.chunks:
            request = self.scheduler.get_request(chunk.request_id)
            if chunk.request_id in connector.streams and request is not None:
                ready = min(chunk.num_computed_tokens + len(chunk.token_ids), request.num_prompt_tokens)
                connector.stream_progress(chunk.request_id, ready,
                                          self.scheduler.kv_cache_manager.block_ids(chunk.request_id))

    def _remote_outputs(self, update: StepUpdate, finished: dict[str, Request], stats: IterationStats,
                        now: float) -> list[EngineCoreOutput]:
        """P/D consumer: the producer's first token of each request whose load finished this step
        (with its logprobs when the producer sent them); a load that failed under the "fail" policy
        ends its request with an error."""
        outputs = []
        for request in update.remote_started:
            timing = self._timings.get(request.request_id)
            if timing is None:
                continue
            self._record_token(stats, request, timing, now)
            lp = request.remote_source.first_token_logprobs
            out = EngineCoreOutput(request.request_id, [request.output_token_ids[0]],
                                   [TokenLogprobs(*lp)] if lp is not None and request.sampling_params.logprobs
                                   else None, num_cached_tokens=request.num_cached_tokens or 0)
            if request.request_id in finished:
                out.finish_reason, out.stop_reason = request.finish_reason, request.stop_reason
                stats.finished.append(self._finished_stats(request, timing, now))
                del self._timings[request.request_id]
            outputs.append(out)
        for request in update.finished:
            if (request.remote_source is not None and request.status == RequestStatus.FINISHED_ABORTED
                    and request.request_id in self._timings):
                del self._timings[request.request_id]
                assert self.kv_transfer is not None
                self.kv_transfer.note_failure(request.request_id, str(request.stop_reason))
        return outputs

    @staticmethod
    def _record_token(stats: IterationStats, request: Request, timing: _Timing, now: float,
                      num_tokens: int = 1) -> None:
        stats.num_generation_tokens += num_tokens
        if timing.last_token_time is None:
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.time_to_first_tokens.append(now - timing.arrival_time)
        else:
            stats.inter_token_latencies.append(now - timing.last_token_time)
        timing.last_token_time = now

    @staticmethod
    def _finished_stats(request: Request, timing: _Timing, now: float) -> FinishedRequestStats:
        scheduled = timing.first_scheduled_time or now
        return FinishedRequestStats(
            finish_reason=request.finish_reason or "stop",
            e2e_latency=now - timing.arrival_time,
            queue_time=scheduled - timing.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_generation_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    # Introspection ---------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        """Counters and gauges of the scheduler, the KV cache and the prefix cache (plain numbers)."""
        kv = self.scheduler.kv_cache_manager
        metrics: dict[str, Any] = {
            "scheduler": {
                "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting,
                "num_preemptions": self.scheduler.num_preemptions_total,
                "computed_tokens": self._num_computed_tokens,
            },
            "kv_cache": {
                "num_blocks": kv.num_blocks,
                "num_free_blocks": kv.num_free_blocks,
                "num_cached_blocks": kv.pool.num_cached_blocks,
                "evicted_blocks": kv.pool.num_evicted_blocks,
                "usage": kv.usage,
                "block_bytes": kv.spec.bytes_per_block,
            },
            "state_slots": {
                "num_slots": self.scheduler.state_pool.num_slots,
                "num_free": self.scheduler.state_pool.num_free,
            },
            "executor": {
                "backend": self.config.executor_backend,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "pipeline_parallel_size": self.config.pipeline_parallel_size,
                "batch_queue_size": self.batch_queue_size,
                "batches_in_flight": sum(not so.is_empty for so, _ in self._batch_queue),
                "max_batches_in_flight": self._max_batches_in_flight,
                **self.executor.metrics(),  # the mp executor: each stage's busy seconds and steps
            },
        }
        if self.kv_transfer is not None:
            metrics["kv_transfer"] = {**self.kv_transfer.metrics(),
                                      "remote_waiting": len(self.scheduler.remote_waiting)}
        if self.offload is not None:
            metrics["offload"] = {**self.offload.snapshot(self.offload_rank_stats),
                                  "loading_requests": len(self.scheduler.tier_waiting)}
        if self.scheduler.spec is not None:
            metrics["spec_decode"] = spec_decode_metrics(self.scheduler.spec.stats)
        pc = self.prefix_cache
        if pc is not None:
            stats = dataclasses.asdict(pc.stats)
            stats["hit_rate"] = pc.stats.hit_tokens / pc.stats.queried_tokens if pc.stats.queried_tokens else 0.0
            stats["checkpoint_interval"] = pc.checkpoint_interval
            metrics["prefix_cache"] = stats
            cps = pc.checkpoints
            metrics["checkpoints"] = {
                "filed": dict(cps.stats.filed),
                "evicted": dict(cps.stats.evicted),
                "declined_no_units": cps.stats.declined_no_units,
                "num_checkpoints": cps.num_checkpoints,
                "num_pinned": cps.num_pinned,
                "capacity": cps.capacity,
                "bytes_in_use": cps.bytes_in_use,
                "image_bytes": cps.image_bytes,
                "unit_bytes": cps.unit_bytes,
                "units_per_checkpoint": cps.units_per_checkpoint,
                "num_units": cps.num_units,
            }
        return metrics

    def shutdown(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.executor.shutdown()
