"""The per-step metadata every attention-like layer reads, set once per forward by a context manager.

A step's tokens are flattened: the sequences that decode (one new token on top of existing state)
come first, then the prefill chunks (one or more tokens, maybe with earlier chunks already cached).
The model runner builds this object; layers only read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from deltaserve.distributed.dcp_layout import DCPLayout


@dataclass(frozen=True)
class PrefillSequence:
    """One prefill chunk, as the MLA prefill path needs it (host-side numbers, no sync)."""

    token_start: int  # first row of this chunk in the flattened step
    num_new_tokens: int
    num_context_tokens: int  # tokens already cached before this chunk
    block_ids: torch.Tensor  # [num_blocks] long, the blocks holding all num_context + num_new tokens


@dataclass(frozen=True)
class ForwardContext:
    """Metadata of one forward step.

    Shapes: T = tokens in the step, D = decoding sequences (their tokens are rows [0, D)), then
    speculative decoding's verify windows (V of them, rows [D, D + num_verify_tokens)), then the
    prefill chunks (rows [D + num_verify_tokens, T)). MLA decodes every verify token as a row of its
    own (`decode_block_tables` and `decode_seq_lens` cover rows [0, num_mla_decodes)); KDA keeps the
    state after each of them (`verify_state_indices`).
    """

    num_tokens: int
    num_decodes: int
    slot_mapping: torch.Tensor  # [T] long: flat KV slot (block_id * block_size + offset) of each token
    # decode sequences
    decode_state_slots: torch.Tensor  # [D] long
    decode_block_tables: torch.Tensor  # [D + num_verify_tokens, max_blocks] long (padded): MLA's decode rows
    decode_seq_lens: torch.Tensor  # [D + num_verify_tokens] long: cached tokens including the row's own
    # prefill chunks (for KDA, P of them: verify windows excluded)
    prefill_cu_seqlens: torch.Tensor  # [P + 1] long, relative to row D + num_verify_tokens
    prefill_state_slots: torch.Tensor  # [P] long
    prefill_has_initial_state: torch.Tensor  # [P] bool
    prefill_sequences: tuple[PrefillSequence, ...]
    # an upper bound on decode_seq_lens known on the host (CUDA graphs: the model's context), so the MLA
    # decode kernel picks its split count without reading seq_lens back; None: the kernel finds it
    decode_max_seq_len: int | None = None
    # prefill_cu_seqlens on the host, so kernels that plan their chunks on the CPU need no device read
    prefill_cu_seqlens_cpu: torch.Tensor | None = None
    # decode context parallelism: this rank's stripe of every sequence's latents (None: no DCP); the
    # slot mapping already holds local slots, and MLA decodes over dcp.local_seq_lens(decode_seq_lens)
    dcp: DCPLayout | None = None
    # speculative decoding's verify windows: their lengths on the host, [V + 1] offsets relative to row
    # D, and [V, max length] slots (the state after token t of window n goes to slot [n, t])
    # prefix caching: per KDA prefill chunk, the checkpoints captured inside it, (tokens of the chunk before
    # the point, the chunk's state slot, unit ids) each, in order; () when no chunk captures any
    prefill_captures: tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...] = ()
    num_verify_tokens: int = 0
    verify_seq_lens: tuple[int, ...] = ()
    verify_cu_seqlens: torch.Tensor | None = None
    verify_state_indices: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_sequences)

    @property
    def num_mla_decodes(self) -> int:
        """Rows MLA decodes: the decode rows and every verify window's tokens."""
        return self.num_decodes + self.num_verify_tokens


def no_prefill_fields(device: torch.device) -> dict[str, object]:
    """ForwardContext's prefill fields for a step without prefill chunks (decode rows and verify windows)."""
    long = {"dtype": torch.long, "device": device}
    return {"prefill_cu_seqlens": torch.zeros(1, **long), "prefill_state_slots": torch.zeros(0, **long),
            "prefill_has_initial_state": torch.zeros(0, dtype=torch.bool, device=device),
            "prefill_sequences": ()}


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` visible to the layers for the duration of one forward pass."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: run the model inside set_forward_context(...)")
    return _current
