"""KDA state checkpoints: immutable images of a request's whole KDA state, filed by block hash.

An image (every KDA layer's conv window and recurrent state) is stored in fixed-size units drawn
from one pool, `units_per_checkpoint = ceil(image_bytes / unit_bytes)`, so images of any size share
one budget and nothing fragments. Plain Python: unit ids only; the worker owns the bytes.

A checkpoint has two readers, with two rules (docs/architecture.md, "Steps in flight"):
- `visible`: later steps may load it. Set once the step that saves it is scheduled: every rank runs
  steps in order, so a load in a later step runs after the save.
- `written`: readers outside the step stream (an offload store, a KV transfer, another tier) and
  eviction may touch it. Set once the worker has reported, in its output for the saving step, that
  the image is written.
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
    visible: bool = False  # later steps may load it (its save is scheduled)
    written: bool = False  # the worker reported the save: readers outside the step stream may use it
    pins: int = 0  # steps in flight that load it; a pinned checkpoint is never evicted
    # its KV block was evicted before its save was reported: unfindable now, its units freed once written
    doomed: bool = False


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

    @property
    def num_fileable(self) -> int:
        """How many checkpoints `file` could reserve now: free units and those of evictable checkpoints
        (written, unpinned)."""
        units = len(self._free_units) + sum(len(cp.unit_ids) for cp in self._lru.values()
                                            if cp.pins == 0 and cp.written)
        return units // self.units_per_checkpoint

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
            victim = next((cp for cp in self._lru.values() if cp.pins == 0 and cp.written), None)
            if victim is None:
                self.stats.declined_no_units += 1
                return None
            self.free(victim.block_hash, evicted=True)
        units = [self._free_units.pop() for _ in range(need)]
        cp = Checkpoint(block_hash, num_tokens, kind, units)
        self._lru[block_hash] = cp
        self.stats.filed[kind.value] += 1
        return cp

    def drop(self, block_hash: BlockHash) -> None:
        """Its KV block is gone: the checkpoint can no longer be reached. A written one is freed now; one
        whose save is still to run keeps its units until the save is reported (a step scheduled already
        writes them), unfindable meanwhile."""
        cp = self._lru.get(block_hash)
        if cp is None:
            return
        if cp.written:
            self.free(block_hash, evicted=True)
            return
        if cp.visible and self.on_change is not None:
            self.on_change(block_hash, -1)
        cp.visible, cp.doomed = False, True
        self.stats.evicted[cp.kind.value] += 1

    def publish(self, block_hash: BlockHash) -> None:
        """The step that saves the image is scheduled: later steps may find it. Call after the KV
        blocks it stands on are committed."""
        cp = self._lru.get(block_hash)
        if cp is not None and not cp.visible and not cp.doomed:
            cp.visible = True
            if self.on_change is not None:
                self.on_change(block_hash, +1)

    def mark_written(self, block_hash: BlockHash, checkpoint: Checkpoint) -> None:
        """The worker reported this checkpoint's save (if it is still the one filed at that hash); a
        doomed one is freed now."""
        if self._lru.get(block_hash) is checkpoint:
            if checkpoint.doomed:
                self.free(block_hash)
            else:
                checkpoint.written = True

    def check_invariants(self, pins: dict[BlockHash, int]) -> None:
        """Raise AssertionError unless every unit is free or in exactly one checkpoint, and each
        checkpoint's pins equal `pins` (block hash -> loads by steps in flight)."""
        used = [u for cp in self._lru.values() for u in cp.unit_ids]
        assert len(used) == len(set(used)), "a unit is in two checkpoints"
        assert not set(used) & set(self._free_units), "a unit is both free and in use"
        assert len(used) + len(self._free_units) == self.num_units, "a unit is lost"
        for h, cp in self._lru.items():
            assert cp.block_hash == h and len(cp.unit_ids) == self.units_per_checkpoint
            assert cp.pins == pins.get(h, 0), f"checkpoint at {cp.num_tokens} tokens: {cp.pins} pins, " \
                f"{pins.get(h, 0)} loads in flight"
            assert not cp.written or cp.visible, "written but never published"

    def free(self, block_hash: BlockHash, evicted: bool = False) -> None:
        cp = self._lru.pop(block_hash, None)
        if cp is None:
            return
        self._free_units.extend(reversed(cp.unit_ids))
        if evicted:
            self.stats.evicted[cp.kind.value] += 1
        if cp.visible and self.on_change is not None:
            self.on_change(block_hash, -1)
