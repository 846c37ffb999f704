"""What the offload tier's scheduler side and its rank side exchange: plain data that crosses a
process boundary, and the join of every rank's report.

The scheduler side puts `OffloadMetadata` on a SchedulerOutput: the saves and loads of that step,
each naming objects by the chained prefix hash of the block they end at (every rank turns a hash
into its own key, objects.object_key with its own worker id) and the block ids, checkpoint units or
state slot they move between. A rank answers with `OffloadOutput` on its ModelRunnerOutput; a save
or a load is done once every rank has reported it, and failed if any rank failed it
(`OffloadOutputAggregator`).

When a rank runs them, within the step that carries them (offload/worker_side.py):
- `saves_before`, `loads`: after the step's checkpoint saves_before and before its state loads and
  forward, so they read what earlier steps wrote (an end-of-sequence checkpoint, the blocks of a
  request that just finished) before this step can overwrite a block or unit freed since;
- `saves_after`: after the forward and the step's checkpoint saves_after (a rung or the prompt-end
  anchor this step computed).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVChunkRef:
    """One KV chunk: the hash of the block it ends at, and its blocks in order."""

    block_hash: bytes
    block_ids: list[int]


@dataclass(frozen=True)
class OffloadSave:
    """Store these KV chunks and the state image in checkpoint `unit_ids` (at `state_hash`); either
    part may be empty."""

    save_id: int
    kv_chunks: list[KVChunkRef]
    state_hash: bytes | None
    unit_ids: list[int]


@dataclass(frozen=True)
class OffloadLoad:
    """Load a joint tier hit into a request's new blocks and its state slot, all or nothing."""

    request_id: str
    kv_chunks: list[KVChunkRef]
    state_hash: bytes
    state_slot: int


@dataclass(frozen=True)
class OffloadMetadata:
    saves_before: list[OffloadSave] = field(default_factory=list)
    loads: list[OffloadLoad] = field(default_factory=list)
    saves_after: list[OffloadSave] = field(default_factory=list)


@dataclass
class OffloadOutput:
    """What one rank finished since its last report, and its tiers' counters."""

    saves_done: list[int] = field(default_factory=list)
    saves_failed: list[int] = field(default_factory=list)
    loads_done: list[str] = field(default_factory=list)
    loads_failed: dict[str, str] = field(default_factory=dict)  # request id -> why
    # global rank -> that rank's counters (RankOffloader.stats and TieredStore.stats), replaced whole
    # at each report
    stats: dict | None = None

    @property
    def has_reports(self) -> bool:
        return bool(self.saves_done or self.saves_failed or self.loads_done or self.loads_failed)


class OffloadOutputAggregator:
    """Joins the OffloadOutputs of an engine's ranks: a save or load is reported once every rank
    reported it, as failed if one of them failed it. `stats` of the result are every rank's latest,
    keyed by rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._saves: dict[int, dict[int, bool]] = {}  # save id -> rank -> stored
        self._loads: dict[str, dict[int, str | None]] = {}  # request id -> rank -> None (done) or why it failed
        self.rank_stats: dict[int, dict] = {}

    def add(self, rank: int, output: OffloadOutput | None) -> None:
        if output is None:
            return
        for save_id in output.saves_done:
            self._saves.setdefault(save_id, {})[rank] = True
        for save_id in output.saves_failed:
            self._saves.setdefault(save_id, {})[rank] = False
        for request_id in output.loads_done:
            self._loads.setdefault(request_id, {})[rank] = None
        for request_id, why in output.loads_failed.items():
            self._loads.setdefault(request_id, {})[rank] = f"rank {rank}: {why}"
        if output.stats is not None:
            self.rank_stats.update(output.stats)

    def take(self) -> OffloadOutput:
        """The saves and loads every rank has reported since the last call."""
        out = OffloadOutput(stats=dict(self.rank_stats))
        for save_id, reports in list(self._saves.items()):
            if len(reports) == self.world_size:
                del self._saves[save_id]
                (out.saves_done if all(reports.values()) else out.saves_failed).append(save_id)
        for request_id, reports in list(self._loads.items()):
            if len(reports) == self.world_size:
                del self._loads[request_id]
                failures = [why for why in reports.values() if why is not None]
                if failures:
                    out.loads_failed[request_id] = "; ".join(failures)
                else:
                    out.loads_done.append(request_id)
        return out
