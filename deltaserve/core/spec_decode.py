"""Speculative decoding on the scheduler side: drafts, verify windows, accept counts and state rollback.

Pure Python. A request that is ready to decode (every known token but the last computed, no step in
flight for it) may bring draft tokens: its step then runs a verify window, the last known token and
n <= k drafts, n + 1 tokens. The KDA state cannot be rewound, so the window keeps one state per
position: the request holds k spare state slots beside its live slot, and the window writes the state
after token t into `slots[t]` (slots[0] is the live slot). When the step's output comes back with a
accepted positions (the accepted drafts plus the recovered or bonus token, 1 <= a <= n + 1):
- the request computed `start + a` tokens: the last known token and the a - 1 accepted drafts;
- the state after them sits in slots[a - 1]: copied into the live slot before the next step's forward
  (a state copy every rank makes, every pipeline stage for its own layers);
- the last grid point the accepted tokens crossed (after the prompt) gets its state copied into the
  request's boundary slot, first, as a decode step that crossed it would have; no checkpoint is ever
  filed inside a verify window, so nothing is filed for a rejected draft;
- KV the rejected drafts wrote past `start + a` is never committed: later steps overwrite it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.core.request import Request
from deltaserve.core.scheduler_output import StateCopy

# drafts for a request: (request, how many at most) -> up to that many token ids
DraftProposer = Callable[[Request, int], list[int]]


def spare_key(request_id: str, index: int) -> str:
    """The state-pool owner key of a request's spare slot `index` (1 .. k) for verify windows."""
    return f"{request_id}#spec{index}"


@dataclass(frozen=True)
class VerifyWindow:
    """One request's verify window in a step: tokens [start, start + len(slots)) (the last known token,
    then the drafts), the state after token t going to slots[t]."""

    start: int
    slots: tuple[int, ...]
    boundary_slot: int | None  # prefix caching: the slot that keeps the state at the last grid point crossed

    @property
    def num_drafts(self) -> int:
        return len(self.slots) - 1


@dataclass
class SpecDecodeStats:
    """Counters under vLLM's names: verify windows run, drafts in them, drafts accepted, and accepted
    drafts per position (index j: windows whose draft j was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.append(0)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


def spec_decode_metrics(stats: SpecDecodeStats) -> dict:
    """The counters as plain numbers, with the acceptance rate (accepted / drafted tokens) and the mean
    acceptance length (tokens a verify window emits: accepted drafts + 1)."""
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "accepted_per_position": list(stats.accepted_per_position),
        "acceptance_rate": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0,
        "mean_acceptance_length": 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 0.0,
    }


class SpecDecodeScheduling:
    """What the scheduler asks about speculation: how many drafts a request may verify now, and what
    an applied verify window leaves to do."""

    def __init__(self, num_speculative_tokens: int, proposer: DraftProposer, grid: int | None,
                 lookahead: int = 0) -> None:
        """grid: the checkpoint grid with prefix caching (boundary slots live on it), None without;
        lookahead: tokens of KV blocks to hold past each chunk (a model drafter writes its drafts there)."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be at least 1")
        self.k = num_speculative_tokens
        self.proposer = proposer
        self.grid = grid
        self.lookahead = lookahead
        self.stats = SpecDecodeStats()

    def drafts(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Drafts for a request ready to decode: none for one asking for logprobs (its tokens come from
        the plain sampler), and never more than the budget, max_tokens or max_model_len leave room for."""
        params = request.sampling_params
        if params is not None and getattr(params, "logprobs", None) is not None:
            return []
        room = min(self.k, budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   max_model_len - request.num_tokens - 1)
        if room < 1:
            return []
        return list(self.proposer(request, room))[:room]

    def rollback(self, request: Request, window: VerifyWindow, num_accepted: int) -> list[StateCopy]:
        """After a window of which `num_accepted` positions were accepted (1 .. num_drafts + 1): set the
        request's computed tokens and boundary, count the drafts, and return the state copies (boundary
        first) that put the accepted state in the live slot."""
        if not 1 <= num_accepted <= len(window.slots):
            raise ValueError(f"{request.request_id}: {num_accepted} positions accepted of a verify window of "
                             f"{len(window.slots)}")
        self.stats.record(window.num_drafts, num_accepted - 1)
        end = window.start + num_accepted
        request.num_computed_tokens = end
        copies = []
        if self.grid is not None and window.boundary_slot is not None:
            point = end // self.grid * self.grid
            if point > window.start and point > request.num_prompt_tokens:
                copies.append(StateCopy(window.slots[point - window.start - 1], window.boundary_slot))
                request.boundary_num_tokens = point
        if num_accepted > 1:
            copies.append(StateCopy(window.slots[num_accepted - 1], window.slots[0]))
        return copies
