"""MLA staging for decode-context-parallel consumers (`staging_chunk_pages` > 0 on a producer).

At interleave 1 a DCP consumer rank holds every dcp_size-th token, so reading its latents straight
from the producer's pages takes one descriptor per token per MLA layer. With staging, the producer
rank gathers a chunk of that rank's tokens into a staging slot, contiguous and in the consumer's
order, and the consumer reads the slot with one descriptor per destination page per layer.

Each producer rank holding MLA layers keeps `staging_slots` slots, each `staging_chunk_pages` pages
of its block size for every MLA layer it holds: held back from its cache budget at startup
(`staging_reserve_bytes`), registered with its transfer agent, and advertised in its `RankLayout`.
A `StagingServer` (a ZeroMQ thread on the rank) answers the consumer ranks directly:
- `stage`: gather stripe offsets [start, start + count) of a request's tokens (its producer blocks,
  the consumer's dcp_size, dcp_rank and interleave) into a free slot; answers the slot, or busy;
- `unstage`: the consumer has read the slot; it is free again.
A slot not unstaged within the timeout (the consumer died) is taken back. The gather reads blocks the
producer's scheduler holds for the transfer, which no step writes, so it needs no lock with the steps.

On CUDA each slot has its own gather stream (`stream_priority`, -1 by default, so a gather is not
queued behind the steps' kernels), each warmed at startup by a gather of one row (a cold stream stalled
a reference deployment's first pushes for 20-100 s); `stage` answers once its stream has finished, so
the consumer's read finds the slot filled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import torch

from deltaserve.kv_transfer.layout import TensorRows
from deltaserve.kv_transfer.side_channel import JsonServer

logger = logging.getLogger(__name__)


def staging_reserve_bytes(chunk_pages: int, slots: int, block_size: int, latent_dim: int, dtype_bytes: int,
                          num_mla_layers: int) -> int:
    """Bytes one producer rank holds back from its caches for its staging slots."""
    return slots * chunk_pages * block_size * latent_dim * dtype_bytes * num_mla_layers


def stripe_positions(start: int, count: int, dcp_size: int, dcp_rank: int, interleave: int) -> list[int]:
    """Token positions of stripe offsets [start, start + count) of DCP rank `dcp_rank`: offset o is
    position (o // interleave) * dcp_size * interleave + dcp_rank * interleave + o % interleave."""
    period = dcp_size * interleave
    return [(o // interleave) * period + dcp_rank * interleave + o % interleave for o in range(start, start + count)]


class StagingPool:
    """A producer rank's staging slots: per MLA layer id a tensor [slots, chunk_pages * block_size,
    latent_dim], and which slots are held (with the time each is taken back)."""

    def __init__(self, caches: dict[int, torch.Tensor], chunk_pages: int, slots: int, block_size: int,
                 stream_priority: int = -1) -> None:
        """caches: per MLA layer id its paged latents [num_blocks, block_size, latent_dim]; on CUDA
        each slot gets a gather stream of `stream_priority`, warmed here."""
        self.block_size = block_size
        self.capacity = chunk_pages * block_size  # tokens one slot holds, per layer
        self.chunk_pages = chunk_pages
        self.caches = caches
        self.slots = {layer: torch.zeros(slots, self.capacity, cache.shape[-1], dtype=cache.dtype,
                                         device=cache.device) for layer, cache in caches.items()}
        self._free = list(range(slots))
        self._held: dict[int, float] = {}  # slot -> deadline
        self.num_slots = slots
        device = next(iter(caches.values())).device if caches else torch.device("cpu")
        self.streams: list[torch.cuda.Stream] | None = None
        if device.type == "cuda":
            self.streams = [torch.cuda.Stream(device, priority=stream_priority) for _ in range(slots)]
            for slot, stream in enumerate(self.streams):  # warm each stream: a first gather of one row
                with torch.cuda.stream(stream):
                    for layer, cache in caches.items():
                        self.slots[layer][slot, :1] = cache.view(-1, cache.shape[-1])[:1]
                stream.synchronize()

    def rows(self) -> dict[int, TensorRows]:
        return {layer: TensorRows.of(t) for layer, t in self.slots.items()}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stage(self, block_ids: list[int], num_tokens: int, start: int, count: int, dcp_size: int, dcp_rank: int,
              interleave: int, hold_s: float) -> int | None:
        """Gathers the stripe's offsets [start, start + count) into a free slot; its index, or None
        when every slot is held. ValueError when the request does not cover those tokens."""
        self.reclaim()
        if not 0 < count <= self.capacity:
            raise ValueError(f"a staged chunk of {count} tokens does not fit a slot of {self.capacity}")
        positions = stripe_positions(start, count, dcp_size, dcp_rank, interleave)
        if positions[-1] >= num_tokens or positions[-1] // self.block_size >= len(block_ids):
            raise ValueError(f"stripe offsets [{start}, {start + count}) reach token {positions[-1]}, past the "
                             f"request's {num_tokens} tokens in {len(block_ids)} blocks")
        if not self._free:
            return None
        slot = self._free.pop()
        self._held[slot] = time.monotonic() + hold_s
        blocks = torch.tensor(block_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
        stream = self.streams[slot] if self.streams is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer, cache in self.caches.items():
                flat = cache.view(-1, cache.shape[-1])
                self.slots[layer][slot, :count] = flat.index_select(0, rows.to(flat.device, non_blocking=True))
        if stream is not None:
            stream.synchronize()  # the consumer reads the slot as soon as it has the answer
        return slot

    def unstage(self, slot: int) -> None:
        if self._held.pop(slot, None) is not None:
            self._free.append(slot)

    def reclaim(self) -> None:
        """Takes back slots held past their deadline (a consumer that never unstaged)."""
        now = time.monotonic()
        for slot in [s for s, deadline in self._held.items() if deadline <= now]:
            logger.warning("kv transfer: staging slot %d was not unstaged in time; taken back", slot)
            self.unstage(slot)


class StagingServer(JsonServer):
    """Serves `stage` and `unstage` for one rank's StagingPool on host (a free port)."""

    def __init__(self, pool: StagingPool, host: str, hold_s: float) -> None:
        super().__init__(host, 0, "staging")
        self.pool = pool
        self.hold_s = hold_s
        self._thread.start()

    def _answer(self, message: dict[str, Any]) -> bytes:
        kind = message["kind"]
        if kind == "stage":
            slot = self.pool.stage([int(b) for b in message["block_ids"]], int(message["num_tokens"]),
                                   int(message["start"]), int(message["count"]), int(message["dcp_size"]),
                                   int(message["dcp_rank"]), int(message["interleave"]), self.hold_s)
            return json.dumps({"slot": slot}).encode()
        if kind == "unstage":
            self.pool.unstage(int(message["slot"]))
            return b'{"ok": true}'
        raise ValueError(f"unknown kind {kind!r}")
