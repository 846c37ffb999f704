"""The engine loop: validate and admit requests, step (schedule, execute, process outputs), abort.

`step()` is three calls: the scheduler decides, the executor runs the model, the output processor
turns sampled ids into text and finished requests. Everything the scheduler hands the executor is
plain data.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan, default_checkpoint_interval, plan_cache
from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from deltaserve.executor.uniproc import UniProcExecutor
from deltaserve.model_files.embedded import embedded_model_dir
from deltaserve.model_files.tokenizer import load_tokenizer
from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.worker.runner_output import ModelRunnerOutput, TokenLogprobs

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | dict[str, Any]


@dataclass
class _Tracked:
    """What the engine keeps per request besides the scheduler's view of it."""

    request: Request
    prompt: str | None
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    finish_reason: str | None = None


class LLMEngine:
    """Single-stage engine: one executor, one scheduler."""

    def __init__(self, config: EngineConfig, model: Any = None) -> None:
        self.config = config
        self.model_dir = config.model or embedded_model_dir()
        self.model_config = KimiLinearConfig.from_pretrained(self.model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir, config.trust_remote_code)
        self.max_model_len = self._resolve_max_model_len()
        self.executor = UniProcExecutor(config, self.model_config, self.model_dir, model)
        kv_spec, state_spec = self.executor.cache_specs()
        caching = config.enable_prefix_caching
        slots_per_seq = 2 if caching else 1  # prefix caching: a boundary slot beside the live one
        self.cache_plan: CachePlan = plan_cache(
            self.executor.available_cache_bytes(), kv_spec, state_spec, config.max_num_seqs, self.max_model_len,
            slots_per_seq=slots_per_seq,
            checkpoint_fraction=config.state_checkpoint_fraction if caching else 0.0,
            checkpoint_unit_bytes=config.state_checkpoint_unit_bytes,
        )
        if config.num_kv_blocks is not None:
            self.cache_plan = dataclasses.replace(self.cache_plan, num_blocks=config.num_kv_blocks)
        self.executor.initialize_cache(self.cache_plan)
        kv_manager = KVCacheManager(kv_spec, self.cache_plan.num_blocks, enable_prefix_caching=caching)
        self.prefix_cache: PrefixCache | None = None
        if caching:
            interval = config.state_checkpoint_interval or default_checkpoint_interval(kv_spec, state_spec)
            units = CheckpointPool(
                self.cache_plan.num_checkpoint_units,
                max(self.cache_plan.checkpoint_unit_bytes, 1),
                state_spec.bytes_per_image,
            )
            self.prefix_cache = PrefixCache(kv_manager, units, interval)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=min(config.max_num_seqs, self.cache_plan.num_state_slots // slots_per_seq),
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            kv_manager,
            StateSlotPool(self.cache_plan.num_state_slots),
            self.prefix_cache,
        )
        self.eos_token_ids = self._eos_token_ids()
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()
        self._num_computed_tokens = 0
        logger.info(
            "deltaserve engine: model=%s dtype=%s device=%s kv_blocks=%d (block_size %d) state_slots=%d "
            "checkpoint_units=%d x %d bytes prefix_caching=%s",
            self.model_dir, self.executor.worker.dtype, self.executor.worker.device,
            self.cache_plan.num_blocks, config.block_size, self.cache_plan.num_state_slots,
            self.cache_plan.num_checkpoint_units, self.cache_plan.checkpoint_unit_bytes, caching,
        )

    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return model_max
        if self.config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the model's maximum context {model_max}"
            )
        return self.config.max_model_len

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    # Requests --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """A string, {"prompt_token_ids": [...]}, {"prompt": "..."} or a list of ids -> (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: this checkpoint has no tokenizer; pass token ids ({'prompt_token_ids': [...]})"
                )
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field when a request cannot be served. Changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if not token_ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len="
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        for t in params.stop_token_ids or ():
            if not 0 <= t < vocab:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        """Validate and queue one request. A bad request raises ValueError and leaves the engine as it was."""
        if request_id in self._tracked:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate(token_ids, params)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            arrival_index=next(self._arrivals),
            sampling_params=params,
        )
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        tracked = _Tracked(request, text, params, detok, [] if params.logprobs is not None else None)
        self.scheduler.add_request(request)
        self._tracked[request_id] = tracked

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for request_id in ids:
            self._tracked.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

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
        }
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
                "capacity": cps.capacity,
                "bytes_in_use": cps.bytes_in_use,
                "image_bytes": cps.image_bytes,
                "unit_bytes": cps.unit_bytes,
                "units_per_checkpoint": cps.units_per_checkpoint,
                "num_units": cps.num_units,
            }
        return metrics

    # The loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that produced a token."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self._num_computed_tokens += scheduler_output.num_scheduled_tokens
        runner_output = self.executor.execute_model(scheduler_output)
        finished = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_by_request())
        return self._process_outputs(runner_output, {r.request_id for r in finished})

    def _process_outputs(self, runner_output: ModelRunnerOutput, finished_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        stopped_by_string = []
        for request_id, token_id, lp in zip(
            runner_output.request_ids, runner_output.sampled_token_ids, runner_output.logprobs, strict=True
        ):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            if tracked.logprobs is not None and lp is not None:
                tracked.logprobs.append(self._logprob_dict(lp))
                tracked.cumulative_logprob += lp.logprobs[0]
            done = request_id in finished_ids
            if tracked.detokenizer is not None:
                stop = tracked.detokenizer.update([token_id])
                if stop is not None and not done:
                    tracked.stop_reason, done = stop, True
                    stopped_by_string.append(request_id)
                elif stop is not None:
                    tracked.stop_reason = stop
            if done:
                request = tracked.request
                if request_id in stopped_by_string:
                    tracked.finish_reason = "stop"
                else:
                    tracked.finish_reason = request.finish_reason
                    if tracked.stop_reason is None:
                        tracked.stop_reason = request.stop_reason
                del self._tracked[request_id]
            outputs.append(self._make_output(tracked, done))
        if stopped_by_string:
            self.scheduler.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        texts = decode_logprobs(self.tokenizer, lp.token_ids) if self.tokenizer is not None else None
        entry = {lp.token_ids[0]: Logprob(lp.logprobs[0], lp.sampled_rank, texts[0] if texts else None)}
        for rank, (tid, value) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, texts[rank] if texts else None)
        return entry

    def _make_output(self, tracked: _Tracked, finished: bool) -> RequestOutput:
        request = tracked.request
        text = tracked.detokenizer.output_text if tracked.detokenizer is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=tracked.cumulative_logprob if tracked.logprobs is not None else None,
            logprobs=tracked.logprobs,
            finish_reason=tracked.finish_reason if finished else None,
            stop_reason=tracked.stop_reason if finished else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens or 0,
        )
