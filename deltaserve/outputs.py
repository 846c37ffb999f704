"""What `LLM.generate` returns, shaped like vLLM's outputs so user code carries over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """The log-probability of one token, its rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request.

    finish_reason: None while running, then "stop" (EOS, a stop token or a stop string),
        "length" (max_tokens or max_model_len) or "abort".
    stop_reason: the stop token id or stop string that ended it; None for EOS or length.
    logprobs: per generated token, {token_id: Logprob} holding the sampled token and the top-k.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """Everything known about one request after a step; `finished` is True on its last output.

    prompt_logprobs: for a request with SamplingParams.prompt_logprobs, one entry per prompt token:
        None for the first, then {token_id: Logprob} holding that prompt token (given the tokens
        before it) and the top-k at its position; set from the first output on.
    kv_transfer_params: under prefill/decode disaggregation, on a producer's finished output, what a
        consumer needs to fetch this request's KV and KDA state (deltaserve/kv_transfer); under
        chunked transfer also on an output without tokens before it, given when it was added.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, "
            f"num_cached_tokens={self.num_cached_tokens}, metrics={self.metrics})"
        )
