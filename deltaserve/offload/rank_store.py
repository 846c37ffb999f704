"""The rank side of the offload tier: saves a rank's KV chunks and KDA state images to its
TieredStore on a saver thread, and loads joint hits back into its caches.

Which rank runs it: every rank (each PP stage, TP and DCP rank) owns one RankOffloader over its own
caches and its own store, keyed by its own worker id (objects.worker_id), so stages and ranks never
overwrite each other's objects. The scheduler decides what to save and load; this class only moves
bytes and reports.

Saves are asynchronous and bounded:
- `save_kv_chunk` / `save_state` queue a save behind a producer fence (fence.py) and return at once.
  The saver thread waits on the fence, packs the rows to host bytes, and writes them through the
  store. The caller must keep the blocks, slot or units unchanged until `poll()` reports the key:
  the copy reads them after the call returned.
- At most `max_pending_saves` saves are queued or running. A save beyond that is refused (returns
  False, counted in `stats.saves_refused`) instead of blocking: the step loop never waits on the
  offload tier, and a refused save only costs a future hit; the scheduler skips it and frees what it
  held for it.
- `poll()` returns the keys saved (held by at least one tier) and those that failed (no tier took
  them, the pack raised, or the save was dropped by `close(drain=False)`), each exactly once.

Loads are synchronous, on the calling thread (the step thread, before the forward that reads the
loaded rows): every payload is fetched and checked first (a miss, a corrupt object or a payload of
the wrong size fails the whole load and nothing is written), then all are unpacked. The copies into
the caches are queued on the caller's current stream, so the forward queued after them reads the
loaded rows without further synchronisation. This is the simpler of the two correct designs; a load
that overlaps steps can be layered on later behind the same all-or-nothing check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from deltaserve.offload.fence import Fence
from deltaserve.offload.rank_caches import RankCaches
from deltaserve.offload.tiered_store import TieredStore

logger = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """Counters of one rank's offloader, as plain numbers for /metrics."""

    saves_queued: int = 0
    saves_refused: int = 0  # refused because max_pending_saves were outstanding, or after close
    saves_done: int = 0
    saves_failed: int = 0  # no tier took the object, or packing raised
    saves_dropped: int = 0  # queued or waiting on their fence when close(drain=False) ran
    saved_bytes: int = 0  # payload bytes of saves_done
    loads_done: int = 0
    loads_missed: int = 0  # all-or-nothing loads that wrote nothing
    loaded_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Save:
    key: str
    pack: Callable[[], memoryview]
    fence: Fence
    nbytes: int = field(default=0)


class RankOffloader:
    """Moves one rank's caches to and from its TieredStore (owned: `close` closes it).

    fence_poll_s: how long the saver waits on a fence before it looks whether `close(drain=False)`
    abandoned the save (bounds how long close takes while a step never completes).
    """

    def __init__(self, caches: RankCaches, store: TieredStore, *, max_pending_saves: int,
                 fence_poll_s: float = 0.05) -> None:
        if max_pending_saves < 1:
            raise ValueError(f"max_pending_saves={max_pending_saves} must be >= 1 (the default is twice the "
                             "pipeline stage count)")
        self.caches = caches
        self.store = store
        self.max_pending_saves = max_pending_saves
        self.fence_poll_s = fence_poll_s
        self.stats = OffloadStats()
        self._queue: deque[_Save] = deque()
        self._num_pending = 0  # queued plus the one being saved
        self._saved: list[str] = []
        self._failed: list[str] = []
        self._closing = False
        self._abandon = False
        self._cond = threading.Condition()
        self._stream = torch.cuda.Stream(caches.device) if caches.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="offload-saver", daemon=True)
        self._thread.start()

    # Saves -----------------------------------------------------------------------------------
    def save_kv_chunk(self, key: str, block_ids: Sequence[int], fence: Fence) -> bool:
        """Queues the save of the KV chunk in `block_ids` under `key`, once `fence` is done.
        False when refused (max_pending_saves outstanding, or closed): nothing will be reported."""
        self.caches.check_block_ids(block_ids)
        ids = list(block_ids)
        return self._submit(_Save(key, lambda: self.caches.pack_kv(ids), fence))

    def save_snapshot(self, key: str, pieces: Sequence[torch.Tensor], nbytes: int, fence: Fence) -> bool:
        """Queues the save of a payload already copied on the device (RankCaches.snapshot_kv or
        snapshot_state_units, `nbytes` in all) under `key`: once `fence` (recorded after the copies)
        is done the saver moves it to the host and stores it. The blocks or units it came from may
        change as soon as this returns. False when refused, as save_kv_chunk."""
        held = list(pieces)
        return self._submit(_Save(key, lambda: self.caches.host_bytes(held, nbytes), fence))

    def save_state(self, key: str, fence: Fence, *, state_slot: int | None = None,
                   unit_ids: Sequence[int] | None = None) -> bool:
        """Queues the save of the state image in `state_slot` or in checkpoint units `unit_ids`
        (exactly one) under `key`, once `fence` is done. False when refused, as save_kv_chunk."""
        self.caches.check_state_target(state_slot, unit_ids)
        if state_slot is not None:
            slot = state_slot
            return self._submit(_Save(key, lambda: self.caches.pack_state(slot), fence))
        assert unit_ids is not None
        ids = list(unit_ids)
        return self._submit(_Save(key, lambda: self.caches.pack_state_units(ids), fence))

    def _submit(self, save: _Save) -> bool:
        with self._cond:
            if self._closing or self._num_pending >= self.max_pending_saves:
                self.stats.saves_refused += 1
                return False
            self._queue.append(save)
            self._num_pending += 1
            self.stats.saves_queued += 1
            self._cond.notify_all()
        return True

    @property
    def num_pending_saves(self) -> int:
        """Saves queued or running, not yet reported to `poll`."""
        with self._cond:
            return self._num_pending

    def poll(self) -> tuple[list[str], list[str]]:
        """(keys saved, keys failed) since the last poll; each accepted save appears exactly once."""
        with self._cond:
            saved, failed = self._saved, self._failed
            self._saved, self._failed = [], []
        return saved, failed

    def drain(self, timeout_s: float | None = None) -> bool:
        """Blocks until no save is pending or `timeout_s` passed; returns whether none is pending."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_pending == 0, timeout_s)

    # Loads -----------------------------------------------------------------------------------
    def load(self, kv_keys: Sequence[str], block_ids_per_chunk: Sequence[Sequence[int]], state_key: str | None,
             *, state_slot: int | None = None, unit_ids: Sequence[int] | None = None) -> bool:
        """All-or-nothing: loads KV chunk `kv_keys[i]` into blocks `block_ids_per_chunk[i]` and the
        state image `state_key` into `state_slot` or checkpoint units `unit_ids` (exactly one; none
        when state_key is None). Returns False, having written nothing, if any object misses, is
        corrupt, or has the wrong size. Synchronous; the device copies queue on the current stream."""
        if len(kv_keys) != len(block_ids_per_chunk):
            raise ValueError(f"load: {len(kv_keys)} kv_keys but {len(block_ids_per_chunk)} block id lists")
        for block_ids in block_ids_per_chunk:
            self.caches.check_block_ids(block_ids)
        if state_key is not None:
            self.caches.check_state_target(state_slot, unit_ids)
        elif state_slot is not None or unit_ids is not None:
            raise ValueError("load: a state_slot or unit_ids without a state_key to load into them")
        wanted = [(key, self.caches.kv_chunk_bytes(len(ids))) for key, ids in zip(kv_keys, block_ids_per_chunk,
                                                                                   strict=True)]
        if state_key is not None:
            wanted.append((state_key, self.caches.state_image_bytes))
        payloads = []
        for key, nbytes in wanted:
            payload = self.store.load(key)
            if payload is None or len(payload) != nbytes:
                if payload is not None:
                    logger.warning("offload: %s holds %d bytes where this rank's layout takes %d; not loaded",
                                   key, len(payload), nbytes)
                self.stats.loads_missed += 1
                return False
            payloads.append(payload)
        for payload, block_ids in zip(payloads, block_ids_per_chunk, strict=False):
            self.caches.unpack_kv(payload, block_ids)
        if state_key is not None:
            if state_slot is not None:
                self.caches.unpack_state(payloads[-1], state_slot)
            else:
                assert unit_ids is not None
                self.caches.unpack_state_units(payloads[-1], unit_ids)
        self.stats.loads_done += 1
        self.stats.loaded_bytes += sum(len(p) for p in payloads)
        return True

    # Lifetime --------------------------------------------------------------------------------
    def close(self, drain: bool = True) -> None:
        """Refuses new saves, then either finishes every pending save (drain) or drops those not yet
        packed (reported as failed by `poll`), stops the saver thread, and closes the store. A second
        call does nothing."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            if not drain:
                self._abandon = True
                while self._queue:
                    self._finish(self._queue.popleft(), None)
            self._cond.notify_all()
        self._thread.join()
        self.store.close()

    def _run(self) -> None:
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._queue or self._closing)
                    if not self._queue:
                        return
                    save = self._queue.popleft()
                outcome = self._perform(save)
                with self._cond:
                    self._finish(save, outcome)
                    self._cond.notify_all()

    def _perform(self, save: _Save) -> bool | None:
        """Waits on the fence, packs and stores; True: stored, False: failed, None: abandoned."""
        while not save.fence.wait(self.fence_poll_s):
            if self._abandon:
                return None
        try:
            payload = save.pack()
            save.nbytes = payload.nbytes
            return self.store.save(save.key, payload) > 0
        except Exception:
            logger.exception("offload: saving %s failed", save.key)
            return False

    def _finish(self, save: _Save, outcome: bool | None) -> None:
        """Records the outcome of a save (None: dropped); called with the lock held."""
        self._num_pending -= 1
        if outcome:
            self._saved.append(save.key)
            self.stats.saves_done += 1
            self.stats.saved_bytes += save.nbytes
            return
        self._failed.append(save.key)
        if outcome is None:
            self.stats.saves_dropped += 1
        else:
            self.stats.saves_failed += 1
