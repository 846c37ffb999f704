"""What the scheduler tells the workers each step: plain data, ready to cross a process boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A token the scheduler does not know yet: sampled by a step still in flight (async scheduling). It is
# always the last token of a one-token decode chunk; the worker puts in the id it sampled for that
# request in its previous step, which it keeps on the device.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled, so workers learn its sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any


@dataclass(frozen=True)
class PromptLogprobTargets:
    """The prompt tokens whose logprobs a chunk computes, for a request with prompt_logprobs.

    The logits at chunk rows [start, start + len(token_ids)) give the logprobs of `token_ids`: each
    is the prompt token after its row, so the last one is the next chunk's first token when the
    chunk ends inside the prompt. The last prompt token's row samples; it has no target.
    """

    start: int  # the first row, an index into the chunk's tokens
    token_ids: list[int]

    @property
    def first_position(self) -> int:
        """Offset of the first target from the chunk's first token (its prompt position is
        num_computed_tokens + first_position)."""
        return self.start + 1


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [num_computed_tokens, num_computed_tokens + len(token_ids)) of one request, to compute now.

    Block tables are sent incrementally, as in vLLM v1: workers keep each request's table across
    steps. `new_block_ids` are the blocks appended since the request was last scheduled; with
    `table_reset` (a request new to the workers, or readmitted after a preemption) they are its whole
    table. Workers drop a table when the request shows up in `finished_request_ids` or
    `preempted_request_ids`.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int  # tokens already in the caches before this chunk
    new_block_ids: list[int]  # appended to the request's block table, which then covers the chunk's end
    table_reset: bool  # the table starts over with new_block_ids
    state_slot: int
    sample: bool  # the chunk reaches the last known token: sample the next one
    num_output_tokens: int  # tokens generated so far, placeholders included (seeds per-request sampling)
    prompt_logprob_targets: PromptLogprobTargets | None = None  # set only for requests with prompt_logprobs
    # speculative decoding: a verify window (the last known token, then drafts) writes the state after
    # token t into slot verify_state_slots[t] (the first is state_slot); () for any other chunk
    verify_state_slots: tuple[int, ...] = ()
    # prefix caching: checkpoints filed inside the chunk, (tokens of the chunk before it, unit ids) each:
    # the KDA state there is written into those units during the forward (the chunk's end is saved
    # from its slot by state_saves_after, as before)
    state_captures: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def is_verify(self) -> bool:
        return bool(self.verify_state_slots)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StateSave:
    """Copy the KDA state image in `state_slot` into checkpoint units."""

    state_slot: int
    unit_ids: list[int]


@dataclass(frozen=True)
class StateLoad:
    """Copy a checkpoint's image from its units into `state_slot` (a prefix hit starts from it)."""

    unit_ids: list[int]
    state_slot: int


@dataclass(frozen=True)
class StateCopy:
    """Copy slot to slot: a decoding request's state at the block boundary it just crossed."""

    src_slot: int
    dst_slot: int


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # workers drop what they keep for these
    preempted_request_ids: list[str] = field(default_factory=list)  # and their block tables for these
    num_scheduled_tokens: int = 0
    # KDA state traffic, in the order the worker runs it: copies_before (speculative decoding's rollbacks),
    # saves_before and loads before the forward, saves_after and copies_after after it
    state_copies_before: list[StateCopy] = field(default_factory=list)
    state_saves_before: list[StateSave] = field(default_factory=list)
    state_loads: list[StateLoad] = field(default_factory=list)
    state_saves_after: list[StateSave] = field(default_factory=list)
    state_copies_after: list[StateCopy] = field(default_factory=list)
    # P/D: the KV connector's loads to start (kv_transfer.metadata.KVConnectorMetadata), and whether the
    # worker side must report finished transfers even in a step with nothing else to do
    kv_connector_metadata: Any = None
    poll_kv_connector: bool = False
    # offload tier: its saves and loads (offload.metadata.OffloadMetadata), and whether the ranks must
    # report saves in flight even in a step with nothing else to do
    offload_metadata: Any = None
    poll_offload: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.finished_request_ids or self.state_saves_before or self.state_copies_before
                    or self.kv_connector_metadata is not None or self.poll_kv_connector
                    or self.offload_metadata is not None or self.poll_offload)
