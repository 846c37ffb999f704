"""Where each token's MLA latent lives under decode context parallelism (DCP).

With `dcp` ranks in a DCP group, interleave `S` and a local page of `block_size` tokens, one
scheduler block covers `block_size * dcp` tokens and has the same block id on every rank. Within
that block, the token at offset `off` belongs to DCP rank `(off // S) % dcp` and sits at local
offset `(off // (dcp * S)) * S + off % S` of that rank's page (vLLM's layout). So each rank's
tokens of a sequence fill its pages in order, with no holes: the first `local_len` local slots of
the sequence, where `local_len` is what `local_seq_lens` counts. A rank's paged decode kernel then
runs unchanged over its own stripe, with its own sequence lengths.

Every function takes tensors (any integer dtype, any device) and is built from elementwise ops, so
it runs inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DCPLayout:
    """The stripe of DCP rank `rank` of `size`, pages of `block_size` local tokens, interleave `interleave`."""

    size: int
    rank: int
    block_size: int
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"DCP rank {self.rank} of a group of {self.size} is out of range")
        if self.interleave < 1 or self.block_size % self.interleave:
            raise ValueError(
                f"dcp_kv_cache_interleave_size={self.interleave} must be a positive divisor of "
                f"block_size={self.block_size}"
            )

    @property
    def scheduler_block_size(self) -> int:
        """Tokens one scheduler block covers: block_size x size."""
        return self.block_size * self.size

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [T] token positions in their sequence -> [T], the DCP rank that stores each."""
        return (positions % self.scheduler_block_size // self.interleave) % self.size

    def local_offset(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [T] -> [T], each token's offset in its owner's page of that scheduler block."""
        off = positions % self.scheduler_block_size
        return off // (self.size * self.interleave) * self.interleave + off % self.interleave

    def slot_mapping(self, block_ids: torch.Tensor, positions: torch.Tensor, pad_slot: int) -> torch.Tensor:
        """block_ids: [T] each token's scheduler block id, positions: [T] -> [T] long, the local slot
        (block_id * block_size + local offset) of the tokens this rank owns, and `pad_slot` (a scratch
        slot no sequence reads) for the tokens another rank owns: every token is written somewhere,
        with no data-dependent shape."""
        slots = block_ids * self.block_size + self.local_offset(positions)
        return torch.where(self.owner(positions) == self.rank, slots, torch.full_like(slots, pad_slot))

    def local_seq_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """seq_lens: [B] tokens of each sequence -> [B], how many of them this rank stores (its first
        local_len slots of the sequence's pages)."""
        per_round = self.size * self.interleave
        full_rounds, rest = seq_lens // per_round, seq_lens % per_round
        in_last = (rest - self.rank * self.interleave).clamp(min=0, max=self.interleave)
        return full_rounds * self.interleave + in_last

    def local_positions_of_rank(self, seq_len: int, rank: int) -> torch.Tensor:
        """[n] long: the positions (< seq_len) that DCP rank `rank` stores, in its local order."""
        positions = torch.arange(seq_len)
        return positions[self.owner(positions) == rank]
