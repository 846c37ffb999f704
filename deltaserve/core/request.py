"""A request as the scheduler sees it: token ids, progress, status. Plain Python, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deltaserve.core.scheduler_output import PLACEHOLDER_TOKEN_ID, PromptLogprobTargets


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # P/D consumer: blocks and a slot held, its load in flight
    WAITING_FOR_TIER_LOAD = enum.auto()  # offload tier: blocks and a slot held, its hit being loaded
    PREEMPTED = enum.auto()
    # everything after this is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    """One sequence: its prompt, the tokens generated so far and how many of them are computed.

    `num_computed_tokens` chases `num_tokens`: a prefill chunk or a decode step advances it, a
    preemption resets it to 0 (the KDA state cannot be rewound, so recompute starts over).

    With steps in flight (async scheduling) a step that samples for the request leaves a placeholder
    (`num_pending_outputs`) until its output is applied; the next step may already decode on it.

    A request with `prompt_logprobs` needs the logits at every prompt position, so it reads no
    prefix-cache hit until steps have been scheduled for all of them (`num_prompt_logprob_rows`,
    never rewound: a preemption does not compute them twice).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    arrival_index: int = 0
    sampling_params: Any = None  # passed through to the worker untouched
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit when first scheduled
    boundary_num_tokens: int = 0  # position of the state held in the boundary slot (0: none)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    num_pending_outputs: int = 0  # tokens sampled by steps in flight, not applied yet
    prompt_logprobs: bool = False  # wants the logprob of every prompt token after the first
    num_prompt_logprob_rows: int = 0  # prompt positions [0, n) already scheduled to give their next token's
    # P/D: a producer's finished request carries what its consumer needs (kv_transfer/metadata.py); a
    # consumer's request records where its prompt was prefilled, and whether loading it failed
    kv_transfer_params: dict[str, Any] | None = None
    remote_source: Any = None
    remote_load_failed: bool = False
    # offload tier: the tokens a load in flight brings back; set when one failed (admitted without the tier)
    tier_hit_tokens: int = 0
    tier_load_failed: bool = False
    # speculative decoding with a model drafter: the drafts its last step proposed for the next
    spec_token_ids: list[int] = field(default_factory=list)
    draft_state: Any = None  # a drafter's scratch for this request (the n-gram drafter: its token array)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether admission must compute the prompt from the start: some prompt positions still owe
        the logprob of the token after them (position P - 1 samples instead)."""
        return self.prompt_logprobs and self.num_prompt_logprob_rows < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the scheduler may compute up to: known tokens plus the placeholders of steps in flight."""
        return self.num_tokens + self.num_pending_outputs

    def may_run_ahead(self, max_model_len: int) -> bool:
        """Whether another step may decode on the pending placeholders: only while no length limit
        can have ended the request with them (a stop token still may: that step's output is dropped)."""
        return (self.num_output_tokens + self.num_pending_outputs < self.max_tokens
                and self.num_tokens_with_pending < max_model_len)

    def take_prompt_logprob_targets(self, start: int, end: int) -> PromptLogprobTargets | None:
        """The prompt tokens a chunk [start, end) gives logprobs for: those after the positions it computes
        that no earlier step (of this life or one before a preemption) was scheduled for; marks them taken."""
        if not self.prompt_logprobs:
            return None
        first = max(start, self.num_prompt_logprob_rows)
        stop = min(end, self.num_prompt_tokens - 1)  # position P - 1 samples: it has no prompt target
        if first >= stop:
            return None
        self.num_prompt_logprob_rows = stop
        return PromptLogprobTargets(first - start, self.prompt_token_ids[first + 1 : stop + 1])

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) of prompt + output; PLACEHOLDER_TOKEN_ID past the known tokens."""
        known = self.num_tokens
        if stop > known:
            head = self.token_slice(start, known) if start < known else []
            return head + [PLACEHOLDER_TOKEN_ID] * (stop - max(start, known))
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token causes, or None to keep going."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.min_tokens:
            if not self.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
