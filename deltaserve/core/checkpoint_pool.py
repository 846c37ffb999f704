"""KDA state checkpoints: immutable images of a request's whole KDA state, filed by block hash.

An image (every KDA layer's conv window and recurrent state) is stored in fixed-size units drawn
from one pool, `units_per_checkpoint = ceil(image_bytes / unit_bytes)`, so images of any size share
one budget and nothing fragments. Plain Python: unit ids only; the worker owns the bytes.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.core.block_hash import BlockHash


class CheckpointKind(enum.Enum):
    RUNG = "rung"  # every state_checkpoint_interval tokens inside a prompt
    PROMPT_END = "prompt_end"  # the last block boundary of a prompt
    END_OF_SEQUENCE = "end_of_sequence"  # the last block boundary reached by prompt + output
    DEMAND = "demand"  # where a lookup found KV reuse but no checkpoint


@dataclass
class Checkpoint:
    block_hash: BlockHash
    num_tokens: int  # the boundary: the state after tokens [0, num_tokens)
    kind: CheckpointKind
    unit_ids: list[int]
    visible: bool = False  # False until the image has been written by the worker
    pins: int = 0  # steps that load it right now; a pinned checkpoint is never evicted


@dataclass
class CheckpointStats:
    filed: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in CheckpointKind})
    evicted: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in CheckpointKind})
    declined_no_units: int = 0


class CheckpointPool:
    def __init__(self, num_units: int, unit_bytes: int, image_bytes: int) -> None:
        if unit_bytes < 1:
            raise ValueError(f"unit_bytes={unit_bytes} must be at least 1")
        self.unit_bytes = unit_bytes
        self.image_bytes = image_bytes
        self.units_per_checkpoint = max(1, -(-image_bytes // unit_bytes))
        self.num_units = num_units
        self._free_units = list(range(num_units - 1, -1, -1))
        self._lru: OrderedDict[BlockHash, Checkpoint] = OrderedDict()
        self.on_change: Callable[[BlockHash, int], None] | None = None  # servability +1 / -1
        self.stats = CheckpointStats()

    @property
    def num_checkpoints(self) -> int:
        return len(self._lru)

    @property
    def num_free_units(self) -> int:
        return len(self._free_units)

    @property
    def capacity(self) -> int:
        return self.num_units // self.units_per_checkpoint

    @property
    def num_pinned(self) -> int:
        """Checkpoints some scheduled request is about to load from."""
        return sum(1 for cp in self._lru.values() if cp.pins > 0)

    @property
    def bytes_in_use(self) -> int:
        return (self.num_units - len(self._free_units)) * self.unit_bytes

    def get(self, block_hash: BlockHash) -> Checkpoint | None:
        return self._lru.get(block_hash)

    def lookup(self, block_hash: BlockHash) -> Checkpoint | None:
        """A written checkpoint at this boundary, marked most recently used; None if there is none."""
        cp = self._lru.get(block_hash)
        if cp is None or not cp.visible:
            return None
        self._lru.move_to_end(block_hash)
        return cp

    def file(self, block_hash: BlockHash, num_tokens: int, kind: CheckpointKind) -> Checkpoint | None:
        """Reserve units for a new checkpoint (not yet visible); None if one exists or no units can be had."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        need = self.units_per_checkpoint
        if need > self.num_units:
            self.stats.declined_no_units += 1
            return None
        while len(self._free_units) < need:
            victim = next((cp for cp in self._lru.values() if cp.pins == 0 and cp.visible), None)
            if victim is None:
                self.stats.declined_no_units += 1
                return None
            self.free(victim.block_hash, evicted=True)
        units = [self._free_units.pop() for _ in range(need)]
        cp = Checkpoint(block_hash, num_tokens, kind, units)
        self._lru[block_hash] = cp
        self.stats.filed[kind.value] += 1
        return cp

    def publish(self, block_hash: BlockHash) -> None:
        """The image is (or, for a save queued before the next step's loads, will be) written: make it
        findable. Call after the KV blocks it stands on are committed."""
        cp = self._lru.get(block_hash)
        if cp is not None and not cp.visible:
            cp.visible = True
            if self.on_change is not None:
                self.on_change(block_hash, +1)

    def free(self, block_hash: BlockHash, evicted: bool = False) -> None:
        cp = self._lru.pop(block_hash, None)
        if cp is None:
            return
        self._free_units.extend(reversed(cp.unit_ids))
        if evicted:
            self.stats.evicted[cp.kind.value] += 1
        if cp.visible and self.on_change is not None:
            self.on_change(block_hash, -1)
