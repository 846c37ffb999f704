"""`LLM`: the offline batch API, shaped like vLLM's so that users' code carries over."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine, PromptInput
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt or many. A flat list of ints is one tokenized prompt; a list of lists is many."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]
    return prompts


class LLM:
    """Load a Kimi Linear checkpoint (or, with no `model`, the embedded tiny one) and generate.

    Keyword arguments are the engine options of `EngineConfig` (max_num_seqs, max_num_batched_tokens,
    block_size, max_model_len, cache_memory, gpu_memory_utilization, dtype, device, seed,
    tensor_parallel_size, pipeline_parallel_size, pp_max_inflight, ...). With more than one rank the
    engine runs one process per rank (the "mp" executor); `shutdown()` stops them.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        built_model = engine_options.pop("_model", None)
        unknown = sorted(set(engine_options) - set(EngineConfig.option_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown option(s): {', '.join(unknown)}")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_options), model=built_model)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's rank processes (with tensor_parallel_size or pipeline_parallel_size > 1);
        also done at interpreter exit."""
        self.llm_engine.shutdown()

    def get_metrics(self) -> dict[str, Any]:
        """Engine counters: scheduler, KV cache, prefix-cache hits and KDA state checkpoints."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts; returns them in input order.

        Every prompt is validated before any is queued, so one bad prompt raises ValueError and
        nothing runs.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        engine = self.llm_engine
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            try:
                _, token_ids = engine.tokenize_prompt(prompt)
                engine.validate(token_ids, params)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e

        ids = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = str(next(self._request_counter))
            engine.add_request(request_id, prompt, params)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(finished) < len(request_ids) and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
            while engine.has_work_without_requests():
                engine.step()  # steps in flight and the last end-of-sequence saves: done before returning
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
