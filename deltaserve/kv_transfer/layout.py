"""Where one rank's caches lie in memory, as a peer needs it to read them: plain JSON-able data.

A `RankLayout` names the rank's place in its engine's grid, its transfer agent's metadata, and per
model layer id the base address and row size of each cache tensor:
- an MLA layer's paged latents [num_blocks, block_size, latent_dim]: one row per block;
- a KDA layer's conv window [num_slots, conv_dim, W-1] and recurrent state [num_slots, H, K, V]: one
  row per state slot.
Layers are matched between producer and consumer by their model layer id, not by their position in
a stage, so a consumer finds each layer on whichever producer stage holds it.

A layout also says how the rank splits the model: its TP rank of `tp_size` (KDA heads split over TP,
`kda_heads` of them here), and under decode context parallelism its DCP rank of `dcp_size` with
the interleave (which of a request's tokens its pages hold). `kv_transfer/pairing.py` turns a
producer's layouts and a consumer rank's into the reads of one request.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any


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
    block_size: int  # tokens per MLA page row (a DCP rank's local page)
    agent_metadata: str  # the transfer agent's metadata(), base64
    mla: dict[int, TensorRows] = field(default_factory=dict)
    kda: dict[int, tuple[TensorRows, TensorRows]] = field(default_factory=dict)
    kda_heads: int = 0  # KDA heads this rank holds (every KDA layer alike)
    pp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    staging: dict[int, TensorRows] = field(default_factory=dict)  # MLA layer id -> slots (one row each)
    staging_capacity: int = 0  # tokens a staging slot holds per layer (0: this rank does not stage)
    staging_host: str = ""
    staging_port: int = 0  # its StagingServer (kv_transfer/staging.py)

    @property
    def agent_bytes(self) -> bytes:
        return base64.b64decode(self.agent_metadata)

    def with_metadata(self, agent_metadata: str) -> RankLayout:
        return dataclasses.replace(self, agent_metadata=agent_metadata)

    def describe(self) -> str:
        dcp = f", dcp_rank {self.dcp_rank} of {self.dcp_size}" if self.dcp_size > 1 else ""
        return f"pp_rank {self.pp_rank}, tp_rank {self.tp_rank} of tensor_parallel_size={self.tp_size}{dcp}"

    def regions(self) -> list[tuple[int, int]]:
        """Every cache tensor as (address, nbytes), to register with the transfer agent."""
        tensors = [*self.mla.values(), *(t for pair in self.kda.values() for t in pair), *self.staging.values()]
        return [(t.address, t.row_bytes * t.num_rows) for t in tensors]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mla"] = {str(k): asdict(v) for k, v in self.mla.items()}
        data["kda"] = {str(k): [asdict(c), asdict(r)] for k, (c, r) in self.kda.items()}
        data["staging"] = {str(k): asdict(v) for k, v in self.staging.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankLayout:
        try:
            return cls(
                int(data["pp_rank"]), int(data["tp_rank"]), int(data["tp_size"]), int(data["block_size"]),
                str(data["agent_metadata"]),
                {int(k): TensorRows(**v) for k, v in data["mla"].items()},
                {int(k): (TensorRows(**c), TensorRows(**r)) for k, (c, r) in data["kda"].items()},
                int(data["kda_heads"]), int(data["pp_size"]), int(data["dcp_size"]), int(data["dcp_rank"]),
                int(data["dcp_interleave"]),
                {int(k): TensorRows(**v) for k, v in data.get("staging", {}).items()},
                int(data.get("staging_capacity", 0)), str(data.get("staging_host", "")),
                int(data.get("staging_port", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a producer's cache layout is malformed ({e!r})") from None
