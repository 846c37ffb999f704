"""TieredStore: offload objects saved through a list of tiers (fastest first), loaded from the fastest
tier holding a valid copy, with integrity checks and degradation of failing tiers.

Policies:
- Save is write-through: the encoded object goes to every healthy tier, fastest first (as
  LMCache stores to all its backends, and as HiCache's write-through). The slower tiers then hold
  what the fast ones evicted without a demotion path, and the shared tier (Mooncake Store) serves
  other engines from the moment of the save. A tier the object does not fit is skipped.
- Load walks the tiers fastest first. A copy that fails to decode (truncated, corrupt, foreign
  layout) is counted on its tier's `corrupt_objects`, deleted from it, and the walk goes on, so
  a bad object is never returned. A valid copy found in a slower tier is promoted: written to
  every faster healthy tier.
- A tier that raises TierError is degraded: logged once per outage, skipped by every call, and
  probed again after a backoff (`retry_after_s`, doubled after each failed probe up to
  `max_retry_after_s`). The probe is the next real call that reaches the tier; if it succeeds the
  tier is healthy again (logged). No call of this class raises because a tier failed.
- Lookups (`contains`, `contains_all`, `longest_joint_prefix`) trust presence and do not decode;
  a load can therefore still miss after a lookup hit (an object evicted or found corrupt in
  between), and callers must treat the load, not the lookup, as the commitment.

Thread safety: tiers lock their own indexes; the health table here has its own lock, so saves on a
saver thread and lookups on the scheduler thread may overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from deltaserve.offload.objects import CorruptObject, decode, encode
from deltaserve.offload.tiers import Tier, TierError

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TierHealth:
    """Whether a tier is skipped, and until when."""

    degraded: bool = False
    retry_at: float = 0.0
    backoff_s: float = 0.0
    outages: int = 0


class TieredStore:
    """Saves and loads payloads under keys through `tiers`, fastest first, checked by `fingerprint`.

    `fingerprint` names the layout of every payload this store handles (e.g. KV chunk and KDA state
    image shapes, dtype, TP/DCP split); objects written under another fingerprint are misses.
    `clock` (seconds, monotonic) is injectable for tests of the backoff.
    """

    def __init__(self, tiers: Sequence[Tier], fingerprint: str, *, retry_after_s: float = 30.0,
                 max_retry_after_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        names = [tier.name for tier in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"TieredStore: tiers {names} must be at least one, with distinct names")
        if not 0 < retry_after_s <= max_retry_after_s:
            raise ValueError(f"TieredStore: need 0 < retry_after_s={retry_after_s} <= "
                             f"max_retry_after_s={max_retry_after_s}")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._clock = clock
        self._health = {tier.name: TierHealth() for tier in self.tiers}
        self._health_lock = threading.Lock()

    def save(self, key: str, payload: bytes | memoryview) -> int:
        """Writes `payload` (a KV chunk or state image, as bytes) through every healthy tier;
        returns how many tiers hold it now (0: nowhere, e.g. every tier degraded)."""
        data = encode(payload, self.fingerprint)
        return sum(self._put(tier, key, data) for tier in self._usable_tiers())

    def load(self, key: str) -> bytes | None:
        """The payload saved under `key` from the fastest tier with a valid copy, or None.
        The copy is promoted to every faster healthy tier."""
        missed: list[Tier] = []
        for tier in self._usable_tiers():
            data = self._call(tier, None, tier.get, key)
            if data is None:
                missed.append(tier)
                continue
            try:
                payload = decode(data, self.fingerprint)
            except CorruptObject as exc:
                tier.count_corrupt()
                logger.warning("offload tier %s: dropping %s: %s", tier.name, key, exc)
                self._call(tier, False, tier.delete, key)
                missed.append(tier)
                continue
            for faster in self._still_usable(missed):
                self._put(faster, key, data)
            return payload
        return None

    def contains(self, key: str) -> bool:
        """Whether some healthy tier holds `key` (presence only; see the module docstring)."""
        return self.contains_all([key])

    def contains_all(self, keys: Sequence[str]) -> bool:
        """All-or-nothing: whether every key is held by some healthy tier (they may be in different
        tiers). For a joint hit pass a prefix's KV chunk keys and the state key at its end."""
        return all(self._presence(list(keys)))

    def longest_joint_prefix(self, kv_keys: Sequence[str], state_keys: Sequence[str]) -> int:
        """The number of chunks n of the longest joint hit: KV chunks 0..n-1 are all held and so is
        the state image at the end of chunk n-1 (`state_keys[i]` is the state key at chunk i's end).
        0 when there is none."""
        if len(kv_keys) != len(state_keys):
            raise ValueError(f"longest_joint_prefix: {len(kv_keys)} kv_keys but {len(state_keys)} state_keys")
        present = self._presence(list(kv_keys) + list(state_keys))
        kv_present, state_present = present[: len(kv_keys)], present[len(kv_keys) :]
        best = 0
        for chunk, kv_held in enumerate(kv_present):
            if not kv_held:
                break
            if state_present[chunk]:
                best = chunk + 1
        return best

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per tier, by name: its counters, its bytes used and cap where the tier knows them, and
        whether it is degraded (0/1) and how many outages it had."""
        out: dict[str, dict[str, int | float]] = {}
        for tier in self.tiers:
            row: dict[str, int | float] = tier.stats.as_dict()
            for field, value in (("used_bytes", tier.used_bytes), ("capacity_bytes", tier.capacity_bytes)):
                if value is not None:
                    row[field] = value
            health = self._health[tier.name]
            row["degraded"] = int(health.degraded)
            row["outages"] = health.outages
            out[tier.name] = row
        return out

    def degraded_tiers(self) -> list[str]:
        return [name for name, health in self._health.items() if health.degraded]

    def close(self) -> None:
        """Closes every tier; a tier that fails to close is logged and skipped."""
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("offload tier %s failed to close", tier.name)

    def _presence(self, keys: list[str]) -> list[bool]:
        present = [False] * len(keys)
        for tier in self._usable_tiers():
            missing = [i for i, held in enumerate(present) if not held]
            if not missing:
                break
            answers = self._call(tier, None, tier.contains_many, [keys[i] for i in missing])
            for i, held in zip(missing, answers or (), strict=False):
                present[i] = held
        return present

    def _put(self, tier: Tier, key: str, data: bytes) -> bool:
        return self._call(tier, False, tier.put, key, data)

    def _usable_tiers(self) -> list[Tier]:
        return self._still_usable(self.tiers)

    def _still_usable(self, tiers: list[Tier]) -> list[Tier]:
        """Those of `tiers` that are healthy or due for a probe (a tier that failed within this call is not)."""
        now = self._clock()
        with self._health_lock:
            return [tier for tier in tiers
                    if not self._health[tier.name].degraded or now >= self._health[tier.name].retry_at]

    def _call(self, tier: Tier, fallback: T, method: Callable[..., T], *args: object) -> T:
        """Runs `method(*args)`, a call on `tier`; on TierError degrades the tier and answers `fallback`."""
        try:
            result = method(*args)
        except TierError as exc:
            self._mark_failed(tier, exc)
            return fallback
        self._mark_served(tier)
        return result

    def _mark_failed(self, tier: Tier, exc: TierError) -> None:
        with self._health_lock:
            health = self._health[tier.name]
            first = not health.degraded
            health.backoff_s = self.retry_after_s if first else min(2 * health.backoff_s, self.max_retry_after_s)
            health.retry_at = self._clock() + health.backoff_s
            health.degraded = True
            health.outages += first
        if first:
            logger.warning("offload tier %s degraded, skipped and retried after %.0f s "
                           "(backoff doubling up to %.0f s): %s",
                           tier.name, self.retry_after_s, self.max_retry_after_s, exc)

    def _mark_served(self, tier: Tier) -> None:
        with self._health_lock:
            health = self._health[tier.name]
            if not health.degraded:
                return
            health.degraded = False
        logger.warning("offload tier %s serves again", tier.name)
