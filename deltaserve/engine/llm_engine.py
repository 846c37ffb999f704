"""The offline engine: input processor -> engine core -> output processor, in one process.

`step()` runs one engine-core step (schedule, execute, apply sampled tokens) and turns its token ids
into text and finished `RequestOutput`s. The API server splits the same three parts across
processes: the core in its own, input and output processing in each front end.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from deltaserve.config.engine_config import EngineConfig
from deltaserve.core.request import RequestStatus
from deltaserve.engine.core import EngineCore, EngineCoreOutput
from deltaserve.engine.output_processor import OutputProcessor
from deltaserve.engine.processor import InputProcessor, ModelInfo, PromptInput
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptInput"]


class LLMEngine:
    """Single-stage engine: one executor, one scheduler, text handled in this process."""

    def __init__(self, config: EngineConfig, model: Any = None) -> None:
        self.config = config
        self.info = ModelInfo.load(config)
        self.model_dir = self.info.model_dir
        self.model_config = self.info.model_config
        self.tokenizer = self.info.tokenizer
        self.max_model_len = self.info.max_model_len
        self.eos_token_ids = self.info.eos_token_ids
        self.core = EngineCore(
            config, self.model_dir, self.model_config, self.max_model_len, self.eos_token_ids, model
        )
        self.processor = InputProcessor(self.info, config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)

    # The parts tests and tools look into
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def prefix_cache(self):
        return self.core.prefix_cache

    @property
    def cache_plan(self):
        return self.core.cache_plan

    @property
    def executor(self):
        return self.core.executor

    # Requests --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        return self.processor.tokenize_prompt(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.processor.validate(token_ids, params)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        """Validate and queue one request. A bad request raises ValueError and leaves the engine as it was."""
        if request_id in self.output_processor:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, core_request = self.processor.process(request_id, prompt, params)
        self.core.add_request(core_request)
        self.output_processor.add_request(request_id, text, core_request.prompt_token_ids, params)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_pending_saves(self) -> bool:
        """End-of-sequence checkpoint saves wait for a step to run them."""
        return self.core.scheduler.has_pending_saves

    def has_work_without_requests(self) -> bool:
        """No request is left, but steps are in flight or end-of-sequence saves wait for a step."""
        return self.core.has_unfinished_requests() and not self.core.num_unfinished_requests

    def get_num_unfinished_requests(self) -> int:
        return self.core.num_unfinished_requests

    def get_metrics(self) -> dict[str, Any]:
        """Counters and gauges of the scheduler, the KV cache and the prefix cache (plain numbers)."""
        return self.core.get_metrics()

    def shutdown(self) -> None:
        """Stop the executor's ranks (the rank processes of a multi-process executor)."""
        self.core.shutdown()

    # The loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that produced a token."""
        core_outputs, _ = self.core.step()
        if self.core.kv_transfer is not None:  # P/D consumer: a failed load ends its request ("fail" policy)
            core_outputs += [EngineCoreOutput(request_id, [], finish_reason="abort", stop_reason=message)
                             for request_id, message in self.core.kv_transfer.take_failures()]
        outputs, stopped_by_string = self.output_processor.process(core_outputs)
        if stopped_by_string:
            self.core.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)
        return outputs
