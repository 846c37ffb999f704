"""Output processing: engine-core outputs (token ids) -> `RequestOutput`s (text, logprobs, finish).

It detokenizes incrementally and checks stop strings. A stop string is found here, not in the core,
so the request it ends is returned to the caller, which must finish it in the core. Prompt logprobs
arrive chunk by chunk (prefill steps that sample nothing produce no output) and are complete by the
first token, so every output of a request that asked carries all of them, as vLLM's cumulative
outputs do. Runs in the offline `LLMEngine` and in each API front-end process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.engine.core import EngineCoreOutput
from deltaserve.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from deltaserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.worker.runner_output import StepPromptLogprobs, TokenLogprobs


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    output_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # None for the first token, then one per prompt token so far
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0


class OutputProcessor:
    """Keeps each live request's text and logprobs; one `process()` call per engine step."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self._states:
            raise ValueError(f"request_id={request_id!r} is already in use")
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self._states[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), params, detok,
            [] if params.logprobs is not None else None, [],
            [None] if params.prompt_logprobs is not None else None,
        )

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the RequestOutputs, and the ids a stop string ended:
        those are finished here but still live in the core, which the caller must tell."""
        results = []
        stopped_by_string = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted by the caller while the step ran
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if not out.new_token_ids and out.finish_reason is None:
                if out.kv_transfer_params is not None:  # a chunked-transfer producer's params, before any token
                    early = self._make_output(state, False, None, None)
                    early.kv_transfer_params = out.kv_transfer_params
                    results.append(early)
                continue  # a prefill chunk's prompt logprobs: kept for the first output
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            state.output_token_ids.extend(out.new_token_ids)
            if state.logprobs is not None and out.new_logprobs:
                for lp in out.new_logprobs:
                    state.logprobs.append(self._logprob_dict(lp))
                    state.cumulative_logprob += lp.logprobs[0]
            if state.detokenizer is not None:
                stop = state.detokenizer.update(out.new_token_ids)
                dropped = state.detokenizer.tokens_after_stop
                if dropped:  # a stop string completed inside a speculative run: the tokens after it go
                    del state.output_token_ids[-dropped:]
                    if state.logprobs is not None and out.new_logprobs:
                        del state.logprobs[-dropped:]
                if stop is not None:
                    if finish_reason is None:
                        stopped_by_string.append(out.request_id)
                    finish_reason, stop_reason = "stop", stop
            finished = finish_reason is not None
            if finished:
                del self._states[out.request_id]
            output = self._make_output(state, finished, finish_reason, stop_reason)
            if finished:
                output.kv_transfer_params = out.kv_transfer_params
            results.append(output)
        return results, stopped_by_string

    def _add_prompt_logprobs(self, state: _RequestState, new: StepPromptLogprobs) -> None:
        """Append a step's prompt logprobs; the core sends each prompt position once, in order."""
        known = state.prompt_logprobs
        if known is None or new.first_position != len(known):
            raise RuntimeError(
                f"{state.request_id}: prompt logprobs from position {new.first_position} arrived, but "
                f"{'none were asked for' if known is None else f'{len(known)} positions are known'}; the "
                "engine core must send each prompt position once, in order, and only when asked"
            )
        known.extend(self._logprob_dict(lp) for lp in new.entries)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        texts = decode_logprobs(self.tokenizer, lp.token_ids) if self.tokenizer is not None else None
        entry = {lp.token_ids[0]: Logprob(lp.logprobs[0], lp.rank, texts[0] if texts else None)}
        for rank, (tid, value) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, texts[rank] if texts else None)
        return entry

    @staticmethod
    def _make_output(state: _RequestState, finished: bool, finish_reason: str | None,
                     stop_reason: int | str | None) -> RequestOutput:
        detok = state.detokenizer
        # while running, hold back the tail that may turn out to be the start of a stop string
        text = detok.get_next_output_text(finished, delta=False) if detok is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(state.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=finish_reason if finished else None,
            stop_reason=stop_reason if finished else None,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=state.prompt_logprobs,
        )
