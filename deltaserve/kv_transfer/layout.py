"""Where one rank's caches lie in memory, as a peer needs it to read them: plain JSON-able data.

A `RankLayout` names the rank's place in its engine's grid, its transfer agent's metadata, and per
model layer id the base address and row size of each cache tensor:
- an MLA layer's paged latents [num_blocks, block_size, latent_dim]: one row per block;
- a KDA layer's conv window [num_slots, conv_dim, W-1] and recurrent state [num_slots, H, K, V]: one
  row per state slot.
Layers are matched between producer and consumer by their model layer id, not by their position in
a stage, so a consumer finds each layer on whichever producer stage holds it.

`load_ops` turns a request's producer blocks and slot into (local, remote, nbytes) ops for a
consumer whose caches are split like the producer's (the same TP rank and block size); the
head-split and DCP-striped reads of heterogeneous pairings are `kv_transfer/topology.py`'s plan.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

from deltaserve.kv_transfer.transfer_engine import TransferOp


@dataclass(frozen=True)
class TensorRows:
    """A cache tensor as rows of `row_bytes` from `address` (row i at address + i * row_bytes)."""

    address: int
    row_bytes: int
    num_rows: int

    def row(self, index: int) -> int:
        if not 0 <= index < self.num_rows:
            raise ValueError(f"row {index} is outside a cache tensor of {self.num_rows} rows")
        return self.address + index * self.row_bytes

    @classmethod
    def of(cls, tensor: Any) -> TensorRows:
        """From a torch tensor whose dim 0 indexes rows (blocks or state slots), contiguous."""
        if not tensor.is_contiguous():
            raise ValueError("a cache tensor registered for transfer must be contiguous")
        return cls(tensor.data_ptr(), tensor[0].numel() * tensor.element_size(), tensor.shape[0])


@dataclass(frozen=True)
class RankLayout:
    """One rank's registered caches. mla: {layer id: latents}; kda: {layer id: (conv, recurrent)}."""

    pp_rank: int
    tp_rank: int
    tp_size: int
    block_size: int  # tokens per MLA page row
    agent_metadata: str  # the transfer agent's metadata(), base64
    mla: dict[int, TensorRows] = field(default_factory=dict)
    kda: dict[int, tuple[TensorRows, TensorRows]] = field(default_factory=dict)

    @property
    def agent_bytes(self) -> bytes:
        return base64.b64decode(self.agent_metadata)

    def regions(self) -> list[tuple[int, int]]:
        """Every cache tensor as (address, nbytes), to register with the transfer agent."""
        tensors = [*self.mla.values(), *(t for pair in self.kda.values() for t in pair)]
        return [(t.address, t.row_bytes * t.num_rows) for t in tensors]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mla"] = {str(k): asdict(v) for k, v in self.mla.items()}
        data["kda"] = {str(k): [asdict(c), asdict(r)] for k, (c, r) in self.kda.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankLayout:
        try:
            return cls(
                int(data["pp_rank"]), int(data["tp_rank"]), int(data["tp_size"]), int(data["block_size"]),
                str(data["agent_metadata"]),
                {int(k): TensorRows(**v) for k, v in data["mla"].items()},
                {int(k): (TensorRows(**c), TensorRows(**r)) for k, (c, r) in data["kda"].items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a producer's cache layout is malformed ({e!r})") from None


def load_ops(local: RankLayout, remote: RankLayout, local_blocks: list[int], remote_blocks: list[int],
             local_slot: int, remote_slot: int, num_tokens: int) -> list[TransferOp]:
    """Ops that copy a request's first `num_tokens` latents and its KDA state from `remote` (one
    producer rank) into `local`, for every layer both hold.

    Both sides must split layers alike (same TP rank of the same TP size) and page alike (same
    block size): blocks then map one to one, the last one partly filled. ValueError otherwise.
    """
    if (local.tp_size, local.tp_rank) != (remote.tp_size, remote.tp_rank):
        raise ValueError(f"a consumer at tp_rank {local.tp_rank} of tensor_parallel_size={local.tp_size} reads a "
                         f"producer at tp_rank {remote.tp_rank} of tensor_parallel_size={remote.tp_size}: only equal "
                         "TP splits are built so far")
    if local.block_size != remote.block_size:
        raise ValueError(f"the consumer's block_size={local.block_size} differs from the producer's "
                         f"{remote.block_size}; run both with the same --block-size")
    num_blocks = -(-num_tokens // local.block_size)
    if len(local_blocks) < num_blocks or len(remote_blocks) < num_blocks:
        raise ValueError(f"{num_tokens} tokens need {num_blocks} blocks on each side "
                         f"(consumer {len(local_blocks)}, producer {len(remote_blocks)})")
    ops: list[TransferOp] = []
    for layer_id, here in local.mla.items():
        there = remote.mla.get(layer_id)
        if there is None:
            continue
        token_bytes = here.row_bytes // local.block_size
        for i in range(num_blocks):
            tokens = min(local.block_size, num_tokens - i * local.block_size)
            ops.append((here.row(local_blocks[i]), there.row(remote_blocks[i]), tokens * token_bytes))
    for layer_id, pair in local.kda.items():
        other = remote.kda.get(layer_id)
        if other is None:
            continue
        for here, there in zip(pair, other, strict=True):
            if here.row_bytes != there.row_bytes:
                raise ValueError(f"KDA layer {layer_id}: a state row is {here.row_bytes} bytes here and "
                                 f"{there.row_bytes} on the producer (different models or dtypes)")
            ops.append((here.row(local_slot), there.row(remote_slot), here.row_bytes))
    return ops


def missing_layers(local: RankLayout, remotes: list[RankLayout]) -> tuple[set[int], set[int]]:
    """The consumer's MLA and KDA layer ids that no producer rank holds (empty when all are covered)."""
    mla = set(local.mla) - {layer for r in remotes for layer in r.mla}
    kda = set(local.kda) - {layer for r in remotes for layer in r.kda}
    return mla, kda
