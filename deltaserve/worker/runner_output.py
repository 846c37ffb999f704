"""What one model step returns to the engine: plain data, safe to send across a process boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: the token's id first (the sampled one, or the prompt's), then the
    row's top-k ids; `rank` is the first id's (1 = most likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass(frozen=True)
class StepPromptLogprobs:
    """One step's prompt logprobs of one request: entry i is the prompt token at position
    `first_position + i`, given the tokens before it."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One entry per request that sampled this step (chunks that ended on their last token), and the
    prompt logprobs of the chunks that computed some (requests with prompt_logprobs)."""

    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: dict[str, StepPromptLogprobs] = field(default_factory=dict)
    kv_connector_output: Any = None  # P/D: kv_transfer.metadata.KVConnectorOutput, loads finished or failed
    offload_output: Any = None  # offload tier: offload.metadata.OffloadOutput, saves and loads finished
    # speculative decoding: a verify window's accepted tokens after its first (which is in sampled_token_ids)
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # speculative decoding with a model drafter: the drafts each request's next step verifies
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def sampled_by_request(self) -> dict[str, int]:
        return dict(zip(self.request_ids, self.sampled_token_ids, strict=True))


class AsyncModelRunnerOutput:
    """A step whose kernels are queued and whose sampled ids are on their way to the host.

    `get_output()` waits for that copy only (not for later steps queued behind it) and returns the
    step's `ModelRunnerOutput`. On the CPU the output is ready when the step returns.
    """

    def __init__(self, resolve: Callable[[], ModelRunnerOutput] | None) -> None:
        self._resolve = resolve
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        handle = cls(None)
        handle._output = output
        return handle

    @property
    def is_ready(self) -> bool:
        """Whether `get_output()` returns without waiting."""
        return self._output is not None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._resolve()
            self._resolve = None
        return self._output
