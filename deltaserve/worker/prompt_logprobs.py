"""Prompt logprobs in the worker: the rows of a step that give them, their logprobs, and the host data
they become.

The scheduler names, per chunk, the prompt tokens whose logprobs the chunk computes
(`ScheduledChunk.prompt_logprob_targets`). The runner flattens them across the step into a
`PromptLogprobPlan`, runs the lm_head on those rows only (never full-vocabulary logits for requests
that did not ask), and `prompt_logprob_tensors` gives, per row, the target token's logprob and rank
and the row's top-k: log_softmax of the raw logits in float32, as for sampled tokens
(`sample/sampler.py`). Rows are taken a slice at a time, so a long prompt chunk holds at most
`ROWS_PER_SLICE` x vocab float32 logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltaserve.core.scheduler_output import PromptLogprobTargets
from deltaserve.sample.sampler import compute_logprobs
from deltaserve.worker.runner_output import StepPromptLogprobs, TokenLogprobs

ROWS_PER_SLICE = 1024


@dataclass
class PromptLogprobPlan:
    """The step's prompt-logprob rows, host side, in row order: per request its target positions and
    k, and per row its index into the step's flat tokens and its target token."""

    request_ids: list[str] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)  # prompt position of each request's first target
    num_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)  # each request's k (SamplingParams.prompt_logprobs)
    rows: list[int] = field(default_factory=list)  # [R] flat row of each target's logits
    targets: list[int] = field(default_factory=list)  # [R] the token each row gives the logprob of

    def add(self, request_id: str, num_computed_tokens: int, flat_start: int, targets: PromptLogprobTargets,
            num_logprobs: int) -> None:
        """One chunk's targets; `flat_start` is the chunk's first row among the step's tokens."""
        n = len(targets.token_ids)
        self.request_ids.append(request_id)
        self.first_positions.append(num_computed_tokens + targets.first_position)
        self.num_rows.append(n)
        self.num_logprobs.append(num_logprobs)
        first_row = flat_start + targets.start
        self.rows.extend(range(first_row, first_row + n))
        self.targets.extend(targets.token_ids)

    @property
    def max_num_logprobs(self) -> int:
        return max(self.num_logprobs, default=0)

    def outputs(self, ints: list[list[int]], values: list[list[float]]) -> dict[str, StepPromptLogprobs]:
        """Per request its StepPromptLogprobs, from the host copies of `prompt_logprob_tensors` (as lists):
        per row, ints holds [target id, rank, top-k ids...] and values [target logprob, top-k...]."""
        result, row = {}, 0
        for request_id, first, n, k in zip(self.request_ids, self.first_positions, self.num_rows,
                                           self.num_logprobs, strict=True):
            entries = [TokenLogprobs([r[0], *r[2 : 2 + k]], v[: 1 + k], r[1])
                       for r, v in zip(ints[row : row + n], values[row : row + n], strict=True)]
            result[request_id] = StepPromptLogprobs(first, entries)
            row += n
        return result


def prompt_logprob_tensors(rows: torch.Tensor, to_logits: Callable[[torch.Tensor], torch.Tensor],
                           targets: torch.Tensor, num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, D] (hidden states, or logits when `to_logits` only casts), targets [R] long ->
    (ints [R, 2 + k] long: target id, its rank, top-k ids; values [R, 1 + k] float32: their logprobs).

    `to_logits` maps a slice of rows to float32 logits [r, V] (the model's lm_head). Nothing here
    reads a tensor back to the host.
    """
    ints, values = [], []
    for i in range(0, rows.shape[0], ROWS_PER_SLICE):
        raw_logprobs = to_logits(rows[i : i + ROWS_PER_SLICE]).float().log_softmax(dim=-1)
        ids, logprobs, ranks = compute_logprobs(raw_logprobs, targets[i : i + ROWS_PER_SLICE], num_logprobs)
        ints.append(torch.cat([ids[:, :1], ranks.unsqueeze(-1), ids[:, 1:]], dim=1))
        values.append(logprobs)
    return torch.cat(ints), torch.cat(values)
