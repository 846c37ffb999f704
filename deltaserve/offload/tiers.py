"""The Tier interface of the offload store, its statistics, a byte-bounded LRU index, and HostTier.

A tier is a key -> bytes store of encoded objects (deltaserve.offload.objects); it does not decode
them: the TieredStore checks every object it reads and counts what fails on the tier it came from.
Keys name content (same key, same bytes), so a put of a key the tier already holds only refreshes
its recency.

Every public call is timed and counted in `stats`; an implementation raises TierError (or any
exception, which the base class turns into one) when the tier itself cannot serve, e.g. a full
disk or a master that is down, and returns False / None for the ordinary outcomes "did not fit" /
"not here". Tiers are safe to call from several threads.

The other tiers live beside this module: DiskTier in disk_tier.py, MooncakeStoreTier in
mooncake_tier.py.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TypeVar

T = TypeVar("T")


class TierError(RuntimeError):
    """A tier could not serve a call (disk full or unwritable, store master unreachable)."""


@dataclass
class TierStats:
    """Counters of one tier, as plain numbers for /metrics. A load is one `get`: a hit or a miss."""

    hits: int = 0
    misses: int = 0
    stores: int = 0  # objects written
    rejected_stores: int = 0  # puts that did not fit (larger than the tier, or no space in the store)
    stored_bytes: int = 0
    loaded_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    corrupt_objects: int = 0  # counted by the reader that failed to decode them
    failures: int = 0  # calls that raised TierError
    store_seconds_sum: float = 0.0
    store_count: int = 0
    load_seconds_sum: float = 0.0
    load_count: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


class LruIndex:
    """Which keys a byte-bounded tier holds, their sizes, least recently used first."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, key: str) -> bool:
        """Marks `key` most recently used; False when it is not held."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def victims_for(self, nbytes: int) -> list[str] | None:
        """The least recently used keys to drop so that `nbytes` more fit; None if they never fit."""
        if nbytes > self.capacity_bytes:
            return None
        victims: list[str] = []
        free = self.capacity_bytes - self.used_bytes
        for key, size in self._sizes.items():
            if free >= nbytes:
                break
            victims.append(key)
            free += size
        return victims

    def admit(self, key: str, nbytes: int) -> list[tuple[str, int]] | None:
        """Records `key` as held and most recently used, dropping the least recently used keys to
        make room; returns the dropped (key, bytes), or None (and changes nothing) if it never fits."""
        victims = self.victims_for(nbytes)
        if victims is None:
            return None
        evicted = [(victim, self.remove(victim)) for victim in victims]
        self.add(key, nbytes)
        return evicted

    def add(self, key: str, nbytes: int) -> None:
        """Records `key` as held and most recently used (call `victims_for` first to make room)."""
        self.used_bytes += nbytes - self._sizes.pop(key, 0)
        self._sizes[key] = nbytes

    def remove(self, key: str) -> int:
        """Forgets `key`; returns the bytes it held (0 if it was not held)."""
        nbytes = self._sizes.pop(key, 0)
        self.used_bytes -= nbytes
        return nbytes

    def keys(self) -> list[str]:
        return list(self._sizes)


class Tier(ABC):
    """One level of the offload store. Subclasses implement the underscored methods."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = TierStats()
        self._stats_lock = threading.Lock()

    # The public calls: counted, timed, and failing only with TierError.

    def put(self, key: str, data: bytes) -> bool:
        """Stores an encoded object; False when it does not fit (nothing else changes then)."""
        start = time.perf_counter()
        stored = self._guarded("put", key, lambda: self._put(key, data))
        with self._stats_lock:
            self.stats.store_seconds_sum += time.perf_counter() - start
            self.stats.store_count += 1
            if stored:
                self.stats.stores += 1
                self.stats.stored_bytes += len(data)
            else:
                self.stats.rejected_stores += 1
        return stored

    def get(self, key: str) -> bytes | None:
        """The encoded object under `key`, or None; a hit makes it the most recently used."""
        start = time.perf_counter()
        data = self._guarded("get", key, lambda: self._get(key))
        with self._stats_lock:
            self.stats.load_seconds_sum += time.perf_counter() - start
            self.stats.load_count += 1
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.loaded_bytes += len(data)
        return data

    def contains(self, key: str) -> bool:
        """Whether the tier holds `key` (not counted as a hit or miss; recency unchanged)."""
        return self._guarded("contains", key, lambda: self._contains(key))

    def contains_many(self, keys: list[str]) -> list[bool]:
        """`contains` for each key, in one call where the tier can batch them."""
        return self._guarded("contains_many", f"{len(keys)} keys", lambda: self._contains_many(keys))

    def delete(self, key: str) -> bool:
        """Drops `key`; False when it was not held."""
        return self._guarded("delete", key, lambda: self._delete(key))

    def count_corrupt(self) -> None:
        """Called by the reader when an object from this tier failed to decode."""
        with self._stats_lock:
            self.stats.corrupt_objects += 1

    def count_evictions(self, evicted_bytes: Iterable[int]) -> None:
        with self._stats_lock:
            for nbytes in evicted_bytes:
                self.stats.evictions += 1
                self.stats.evicted_bytes += nbytes

    @property
    def used_bytes(self) -> int | None:
        """Bytes the tier holds; None when only a remote service knows (a shared store)."""
        return None

    @property
    def capacity_bytes(self) -> int | None:
        """The tier's byte cap; None when a remote service sets and enforces it."""
        return None

    def close(self) -> None:
        """Releases the tier's resources; its contents may persist (disk, a shared store)."""
        return None

    def _guarded(self, call: str, key: str, run: Callable[[], T]) -> T:
        try:
            return run()
        except Exception as exc:
            with self._stats_lock:
                self.stats.failures += 1
            if isinstance(exc, TierError):
                raise
            raise TierError(f"{self.name} tier: {call}({key!r}) failed: {exc!r}") from exc

    @abstractmethod
    def _put(self, key: str, data: bytes) -> bool: ...

    @abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _contains(self, key: str) -> bool: ...

    def _contains_many(self, keys: list[str]) -> list[bool]:
        return [self._contains(key) for key in keys]

    @abstractmethod
    def _delete(self, key: str) -> bool: ...


class LruTier(Tier):
    """A tier with its own byte cap, tracked by an LruIndex under a lock."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name)
        self._index = LruIndex(capacity_bytes)
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes


class HostTier(LruTier):
    """Encoded objects in host memory, least recently used evicted first, at most `capacity_bytes`.

    Objects are held as Python bytes. The seam for pinned memory is `_hold`/`_release`: a subclass
    on a CUDA machine copies into (and frees from) a pinned slab there, so that loads into HBM can
    be asynchronous copies.
    """

    def __init__(self, capacity_bytes: int, name: str = "host") -> None:
        super().__init__(name, capacity_bytes)
        self._objects: dict[str, bytes] = {}

    def _hold(self, data: bytes) -> bytes:
        """The tier's own copy of `data`: bytes are immutable and kept as they are, other buffers are copied."""
        return bytes(data)

    def _release(self, held: bytes) -> None:
        """Frees what `_hold` returned; nothing to do for Python bytes."""

    def _put(self, key: str, data: bytes) -> bool:
        with self._lock:
            if self._index.touch(key):
                return True
            evicted = self._index.admit(key, len(data))
            if evicted is None:
                return False
            for victim, _ in evicted:
                self._release(self._objects.pop(victim))
            self._objects[key] = self._hold(data)
        self.count_evictions(nbytes for _, nbytes in evicted)
        return True

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            if not self._index.touch(key):
                return None
            return self._objects[key]

    def _contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def _delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            self._drop(key)
            return True

    def close(self) -> None:
        """Frees every held object."""
        with self._lock:
            for key in self._index.keys():
                self._drop(key)

    def _drop(self, key: str) -> int:
        self._release(self._objects.pop(key))
        return self._index.remove(key)
