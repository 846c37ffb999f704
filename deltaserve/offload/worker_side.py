"""The offload tier's rank side: runs a step's saves and loads (offload/metadata.py) on this rank's
caches, and reports what finished.

Every rank (each PP stage, TP and DCP rank) builds its own tiers and its own RankOffloader, keyed
by its PP-aware worker id, so stages and ranks never overwrite each other's objects; the disk tier
takes a subdirectory per worker id, and a Mooncake Store is shared (the keys differ).

Within a step (ModelRunner calls `before_forward` between the checkpoint saves_before and the state
loads, and `after_forward` after the saves_after):
- a save copies its rows on the device first (RankCaches.snapshot_*, queued on the compute stream
  behind everything that wrote them), then records the producer fence (fence.py) and hands the
  copies to the saver thread, which waits on the fence before it moves them to the host and stores
  them. So the blocks and units may be reused by the very next kernel: nothing is pinned;
- a load is synchronous and all or nothing (RankOffloader.load), its copies queued before the
  forward that reads them.
`poll()` reports each save once every object of it is stored (or failed), and each load.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from deltaserve.offload.fence import Fence
from deltaserve.offload.metadata import OffloadMetadata, OffloadOutput, OffloadSave
from deltaserve.offload.objects import key_namespace, object_key, worker_id
from deltaserve.offload.rank_caches import RankCaches
from deltaserve.offload.rank_store import RankOffloader
from deltaserve.offload.scheduler_side import rank_tier_capacities
from deltaserve.offload.tiered_store import TieredStore
from deltaserve.offload.tiers import HostTier, Tier

logger = logging.getLogger(__name__)

def rank_tiers(engine_config: Any, rank_id: str, world_size: int) -> list[Tier]:
    """This rank's tiers, fastest first, from the engine's kv_offloading_* options, sized by
    rank_tier_capacities. A Mooncake master that cannot be reached refuses startup (TierError names it)."""
    sizes = iter(rank_tier_capacities(engine_config, world_size))
    tiers: list[Tier] = []
    if engine_config.kv_offloading_size:
        tiers.append(HostTier(next(sizes)))
    if engine_config.kv_offloading_disk_path:
        from deltaserve.offload.disk_tier import DiskTier

        tiers.append(DiskTier(os.path.join(engine_config.kv_offloading_disk_path, rank_id), next(sizes)))
    if engine_config.kv_offloading_remote:
        from deltaserve.offload.mooncake_tier import MooncakeStoreTier

        tiers.append(MooncakeStoreTier(engine_config.kv_offloading_remote, segment_bytes=next(sizes)))
    return tiers


class OffloadWorker:
    """One rank's side of the offload tier over its caches (`caches`) and tiers."""

    def __init__(self, caches: RankCaches, tiers: list[Tier], *, namespace: str, rank_id: str,
                 max_pending_objects: int, global_rank: int = 0) -> None:
        self.caches = caches
        self.global_rank = global_rank
        self.namespace = namespace
        self.rank_id = rank_id
        self.offloader = RankOffloader(caches, TieredStore(tiers, caches.fingerprint()),
                                       max_pending_saves=max_pending_objects)
        self._save_of_key: dict[str, int] = {}  # object key in flight -> its save id
        self._objects_left: dict[int, int] = {}  # save id -> objects not yet reported
        self._save_failed: set[int] = set()
        self._report = OffloadOutput()
        self._active = False  # something happened since the last report: send the counters

    @classmethod
    def build(cls, engine_config: Any, model: Any, parallel: Any, checkpoint_units: torch.Tensor | None,
              max_model_len: int) -> OffloadWorker:
        """From the engine's options, over a model whose caches are bound."""
        caches = RankCaches.from_model(model, checkpoint_units)
        rank_id = worker_id(pp_rank=parallel.pipeline_parallel_rank, pp_size=parallel.pipeline_parallel_size,
                            tp_rank=parallel.tensor_parallel_rank, tp_size=parallel.tensor_parallel_size,
                            dcp_rank=parallel.decode_context_parallel_rank,
                            dcp_size=parallel.decode_context_parallel_size)
        namespace = key_namespace(str(engine_config.model), caches.layout(), engine_config.dtype)
        # the scheduler bounds saves; each is an image and at most every chunk of a context
        chunks = -(-max_model_len // engine_config.kv_offloading_chunk_size)
        max_objects = engine_config.offloading_max_pending_saves * (chunks + 1)
        return cls(caches, rank_tiers(engine_config, rank_id, parallel.world_size), namespace=namespace,
                   rank_id=rank_id, max_pending_objects=max_objects,
                   global_rank=parallel.pipeline_parallel_rank * parallel.tensor_parallel_size
                   + parallel.tensor_parallel_rank)

    def key(self, kind: str, block_hash: bytes) -> str:
        return object_key(self.namespace, block_hash, kind, self.rank_id)  # type: ignore[arg-type]

    # The step's phases -----------------------------------------------------------------------
    def before_forward(self, meta: OffloadMetadata | None) -> None:
        """The saves of what earlier steps wrote, and the loads (before this step writes anything)."""
        if meta is None:
            return
        self._run_saves(meta.saves_before)
        for load in meta.loads:
            self._active = True
            try:
                ok = self.offloader.load([self.key("kv", c.block_hash) for c in load.kv_chunks],
                                         [c.block_ids for c in load.kv_chunks], self.key("state", load.state_hash),
                                         state_slot=load.state_slot)
            except Exception as exc:  # a bad order is a failed load, never a failed step
                logger.exception("offload: loading request %s failed", load.request_id)
                self._report.loads_failed[load.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            if ok:
                self._report.loads_done.append(load.request_id)
            else:
                self._report.loads_failed[load.request_id] = "an object is missing, corrupt or of another layout"

    def after_forward(self, meta: OffloadMetadata | None) -> None:
        """The saves of what this step wrote (its checkpoints' saves_after have run)."""
        if meta is not None:
            self._run_saves(meta.saves_after)

    def _run_saves(self, saves: list[OffloadSave]) -> None:
        if not saves:
            return
        self._active = True
        snapshots: list[tuple[int, str, list[torch.Tensor], int]] = []
        for save in saves:
            for chunk in save.kv_chunks:
                pieces = self.caches.snapshot_kv(chunk.block_ids)
                snapshots.append((save.save_id, self.key("kv", chunk.block_hash), pieces,
                                  self.caches.kv_chunk_bytes(len(chunk.block_ids))))
            if save.state_hash is not None:
                snapshots.append((save.save_id, self.key("state", save.state_hash),
                                  self.caches.snapshot_state_units(save.unit_ids), self.caches.state_image_bytes))
            num_objects = len(save.kv_chunks) + (save.state_hash is not None)
            if num_objects:
                self._objects_left[save.save_id] = num_objects
            else:
                self._report.saves_done.append(save.save_id)
        stream = torch.cuda.current_stream(self.caches.device) if self.caches.device.type == "cuda" else None
        fence = Fence.record(stream)  # behind the copies: the saver waits for them, not for the step
        for save_id, key, pieces, nbytes in snapshots:
            self._save_of_key[key] = save_id
            if not self.offloader.save_snapshot(key, pieces, nbytes, fence):
                self._object_reported(key, stored=False)

    def _object_reported(self, key: str, stored: bool) -> None:
        save_id = self._save_of_key.pop(key, None)
        if save_id is None or save_id not in self._objects_left:
            return
        if not stored:
            self._save_failed.add(save_id)
        self._objects_left[save_id] -= 1
        if self._objects_left[save_id] == 0:
            del self._objects_left[save_id]
            failed = save_id in self._save_failed
            self._save_failed.discard(save_id)
            (self._report.saves_failed if failed else self._report.saves_done).append(save_id)

    # Reports ---------------------------------------------------------------------------------
    def poll(self) -> OffloadOutput | None:
        """Saves and loads finished since the last poll, with this rank's counters (None: nothing
        happened since)."""
        saved, failed = self.offloader.poll()
        for key in saved:
            self._object_reported(key, stored=True)
        for key in failed:
            self._object_reported(key, stored=False)
        if not (self._active or saved or failed or self._report.has_reports):
            return None
        report, self._report = self._report, OffloadOutput()
        report.stats = {self.global_rank: {"rank": self.offloader.stats.as_dict(),
                                           "tiers": self.offloader.store.stats()}}
        self._active = bool(self._objects_left)
        return report

    def close(self) -> None:
        self.offloader.close(drain=False)
