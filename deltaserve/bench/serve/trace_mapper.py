"""Mooncake hash ids -> token ids a served model accepts, so the trace's prefix sharing reaches the server.

Block `h` is 512 token ids drawn from [0, vocab_size) by a generator keyed by (namespace, h): equal
ids give equal blocks; different ids, or another namespace (another level, another run's salt), give
different ones (two blocks of 512 uniform draws agree by chance with probability vocab_size**-512).
A prompt is its blocks in order, cut to input_length, so a partial last block is the leading part of
that id's block. Unlike `bench.cache_sim.prompt_token_ids` (`h * 512 + j`, for a simulation with no
model), every id stays inside the vocabulary.
"""

from __future__ import annotations

import functools

from deltaserve.bench.mooncake import TRACE_BLOCK_TOKENS, TraceRecord
from deltaserve.bench.serve import tokens


class TraceTokenMapper:
    """Token blocks for hash ids, a pure function of (vocab_size, namespace, hash id)."""

    def __init__(self, vocab_size: int, namespace: tokens.Namespace, block_size: int = TRACE_BLOCK_TOKENS) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be at least 2 for distinct trace blocks")
        self.vocab_size = vocab_size
        self.namespace = namespace
        self.block_size = block_size
        self.block = functools.lru_cache(maxsize=4096)(self._make_block)

    def _make_block(self, hash_id: int) -> tuple[int, ...]:
        """The `block_size` token ids of `hash_id` (cached: ids like a shared system prompt recur)."""
        return tuple(self.namespace.tokens(self.vocab_size, self.block_size, tokens.TRACE_BLOCK, hash_id))

    def prompt(self, record: TraceRecord) -> list[int]:
        """The record's prompt: its hash ids' blocks in order, cut to input_length.

        A record with fewer ids than its input_length needs (ceil(input_length / 512)) is refused
        by name: the trace would be asking for tokens it never describes.
        """
        needed = -(-record.input_length // self.block_size)
        if len(record.hash_ids) < needed:
            raise ValueError(
                f"trace record at timestamp {record.timestamp}: input_length={record.input_length} needs "
                f"{needed} hash_ids of {self.block_size} tokens, it has {len(record.hash_ids)}"
            )
        ids: list[int] = []
        for h in record.hash_ids[:needed]:
            ids.extend(self.block(h))
        return ids[: record.input_length]
