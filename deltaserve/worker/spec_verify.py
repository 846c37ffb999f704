"""Speculative decoding on the worker: the verify windows' metadata and their lossless verification.

A verify window is a chunk of the request's last known token and its drafts (`ScheduledChunk.is_verify`).
Its rows sit after the decode rows; MLA computes it as a prefill chunk with context, KDA keeps the state
after each of its tokens in the window's slots (`ForwardContext.verify_state_indices`). Every row's
logits go to the rejection sampler: row j verifies draft j + 1, the last row gives the bonus token.
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.core.scheduler_output import ScheduledChunk
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec.rejection_sampler import RejectionMetadata, RejectionOutput, RejectionSampler


def verify_host_arrays(verifies: list[ScheduledChunk]) -> dict[str, list[int]]:
    """The windows' offsets [V + 1] (relative to the first verify row) and their slots, [V, max length]
    flattened (a short window's row padded with its last slot, which no token past its length reads)."""
    width = max((c.num_tokens for c in verifies), default=0)
    cu, indices = [0], []
    for chunk in verifies:
        slots = list(chunk.verify_state_slots)
        if len(slots) != chunk.num_tokens:
            raise ValueError(f"{chunk.request_id}: a verify window of {chunk.num_tokens} tokens came with "
                             f"{len(slots)} state slots; it needs one per token")
        cu.append(cu[-1] + chunk.num_tokens)
        indices += slots + [slots[-1]] * (width - len(slots))
    return {"verify_cu_seqlens": cu, "verify_state_indices": indices}


def verify_context(verifies: list[ScheduledChunk], dev: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ForwardContext's verify fields from the step's device arrays."""
    if not verifies:
        return {}
    width = max(c.num_tokens for c in verifies)
    return {
        "num_verify_tokens": sum(c.num_tokens for c in verifies),
        "verify_seq_lens": tuple(c.num_tokens for c in verifies),
        "verify_cu_seqlens": dev["verify_cu_seqlens"],
        "verify_state_indices": dev["verify_state_indices"].view(len(verifies), width),
    }


class DraftVerifier:
    """Runs the rejection sampler over one step's verify windows."""

    def __init__(self) -> None:
        self.sampler = RejectionSampler()

    def __call__(self, verifies: list[ScheduledChunk], logits: torch.Tensor,
                 params: list[SamplingParams]) -> RejectionOutput:
        """logits: [sum of window lengths, vocab], the windows' rows in order -> the accepted tokens of
        each window (its accepted drafts, then the recovered or bonus token)."""
        device = logits.device
        drafts = [token for chunk in verifies for token in chunk.token_ids[1:]]
        draft_ids = torch.tensor(drafts, dtype=torch.long)
        if device.type == "cuda":
            draft_ids = draft_ids.pin_memory()
        metadata = RejectionMetadata.from_params(
            params, [c.num_tokens - 1 for c in verifies], [c.num_output_tokens for c in verifies], device)
        return self.sampler(logits, draft_ids.to(device, non_blocking=True), None, metadata)


def verified_tokens(verifies: list[ScheduledChunk], host: list[list[int]]) -> dict[str, list[int]]:
    """Each window's accepted tokens from the host copy of [token ids..., count] rows."""
    return {chunk.request_id: row[: row[-1]] for chunk, row in zip(verifies, host, strict=True)}
