"""TieredStore over host and disk tiers: write-through, promotion, integrity, joint hits, degradation."""

import pytest

from deltaserve.offload.disk_tier import DiskTier
from deltaserve.offload.objects import encode, key_namespace, object_key, worker_id
from deltaserve.offload.tiered_store import TieredStore
from deltaserve.offload.tiers import HostTier
from offload.damage import DAMAGES, FINGERPRINT, blob, damaged_object


class BreakableHostTier(HostTier):
    """A host tier whose calls fail like a dead device while `broken` is set."""

    def __init__(self, capacity_bytes: int, name: str = "host") -> None:
        super().__init__(capacity_bytes, name)
        self.broken = False

    def _put(self, key, data):
        self._fail_if_broken()
        return super()._put(key, data)

    def _get(self, key):
        self._fail_if_broken()
        return super()._get(key)

    def _contains(self, key):
        self._fail_if_broken()
        return super()._contains(key)

    def _fail_if_broken(self):
        if self.broken:
            raise OSError(28, "No space left on device")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def host_and_disk(tmp_path):
    host = HostTier(4000)
    disk = DiskTier(tmp_path / "offload", 100_000)
    store = TieredStore([host, disk], FINGERPRINT)
    yield store, host, disk
    store.close()


def test_save_writes_through_every_tier_and_load_reads_the_fastest(host_and_disk):
    store, host, disk = host_and_disk
    data = blob(1000, seed=1)
    assert store.save("k", data) == 2
    assert host.contains("k") and disk.contains("k")
    assert store.load("k") == data
    assert (host.stats.hits, disk.stats.hits, disk.stats.load_count) == (1, 0, 0)
    assert store.load("missing") is None
    assert (host.stats.misses, disk.stats.misses) == (1, 1)


def test_load_from_disk_promotes_to_host(host_and_disk):
    store, host, disk = host_and_disk
    saved = {f"k{i}": blob(1500, seed=i) for i in range(4)}  # 6000 bytes of objects, host keeps two
    for key, data in saved.items():
        store.save(key, data)
    assert [host.contains(k) for k in saved] == [False, False, True, True]
    assert store.load("k0") == saved["k0"]
    assert disk.stats.hits == 1 and host.contains("k0")
    assert store.load("k0") == saved["k0"]
    assert disk.stats.hits == 1 and host.stats.hits == 1


@pytest.mark.parametrize("damage", DAMAGES)
def test_bad_object_on_disk_is_counted_dropped_and_missed(host_and_disk, damage):
    store, host, disk = host_and_disk
    disk.put("k", damaged_object(blob(2000, seed=7), damage))
    path = disk.path_of("k")
    assert path.exists()

    assert store.load("k") is None
    assert disk.stats.corrupt_objects == 1
    assert not disk.contains("k") and not path.exists()
    assert not host.contains("k")
    assert store.stats()["disk"]["corrupt_objects"] == 1


def test_corrupt_fast_copy_is_repaired_from_a_slower_tier(host_and_disk):
    store, host, disk = host_and_disk
    data = blob(500, seed=3)
    store.save("k", data)
    host.delete("k")
    host.put("k", encode(data, FINGERPRINT)[:-1])
    assert store.load("k") == data
    assert host.stats.corrupt_objects == 1
    assert host.get("k") == encode(data, FINGERPRINT)


def joint_keys(hashes: list[bytes], rank: str) -> tuple[list[str], list[str]]:
    namespace = key_namespace("kimi-linear-48b", FINGERPRINT, "bfloat16")
    kv = [object_key(namespace, h, "kv", rank) for h in hashes]
    state = [object_key(namespace, h, "state", rank) for h in hashes]
    return kv, state


def test_joint_lookup_is_all_or_nothing(host_and_disk):
    store, host, disk = host_and_disk
    rank = worker_id(pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    hashes = [blob(16, seed=100 + i) for i in range(4)]
    kv, state = joint_keys(hashes, rank)
    for i in range(4):
        store.save(kv[i], blob(200, seed=i))
    store.save(state[1], blob(300, seed=11))
    store.save(state[3], blob(300, seed=13))
    host.delete(kv[0])  # chunk 0 is held by the disk only: a hit may span tiers

    assert store.contains_all(kv[:2] + [state[1]])
    assert not store.contains_all(kv[:3] + [state[2]])  # no state image at chunk 2's end
    assert store.longest_joint_prefix(kv, state) == 4
    disk.delete(kv[2])
    assert store.longest_joint_prefix(kv, state) == 4  # chunk 2 is still in host memory
    host.delete(kv[2])
    assert store.longest_joint_prefix(kv, state) == 2  # a hole in the KV cuts the prefix at the last state
    assert not store.contains_all(kv + [state[3]])
    assert store.longest_joint_prefix(kv[:1], state[:1]) == 0
    assert store.longest_joint_prefix([], []) == 0


def test_pipeline_stages_keep_their_own_objects(host_and_disk):
    store, _, _ = host_and_disk
    block_hash = blob(16, seed=5)
    stage_keys = [joint_keys([block_hash], worker_id(pp_rank=p, pp_size=2, tp_rank=0, tp_size=1)) for p in range(2)]
    for stage, (kv, state) in enumerate(stage_keys):
        store.save(kv[0], blob(100, seed=stage))
        store.save(state[0], blob(100, seed=10 + stage))
    for stage, (kv, state) in enumerate(stage_keys):
        assert store.load(kv[0]) == blob(100, seed=stage)
        assert store.load(state[0]) == blob(100, seed=10 + stage)


def test_a_failing_tier_degrades_and_no_call_fails(tmp_path, caplog):
    host = BreakableHostTier(10_000)
    disk = DiskTier(tmp_path / "offload", 100_000)
    clock = FakeClock()
    store = TieredStore([host, disk], FINGERPRINT, retry_after_s=10, max_retry_after_s=40, clock=clock)
    store.save("a", blob(100, seed=1))

    host.broken = True
    assert store.save("b", blob(100, seed=2)) == 1  # disk only
    assert store.degraded_tiers() == ["host"]
    assert store.load("a") == blob(100, seed=1)  # served by disk, host skipped
    assert store.contains_all(["a", "b"])
    assert host.stats.failures == 1  # skipped from then on
    assert sum("host degraded" in r.getMessage() for r in caplog.records) == 1

    clock.now += 10  # the probe fails again: backoff doubles to 20 s
    assert store.load("a") == blob(100, seed=1)
    assert host.stats.failures == 2
    clock.now += 19
    store.load("a")
    assert host.stats.failures == 2
    assert sum("host degraded" in r.getMessage() for r in caplog.records) == 1

    host.broken = False
    clock.now += 1
    assert store.load("b") == blob(100, seed=2)  # the probe succeeds: promoted into host again
    assert store.degraded_tiers() == [] and host.contains("b")
    stats = store.stats()
    assert stats["host"]["degraded"] == 0 and stats["host"]["outages"] == 1
    assert stats["host"]["failures"] == 2 and stats["disk"]["failures"] == 0
    store.close()


def test_every_tier_degraded_answers_misses(tmp_path):
    host = BreakableHostTier(10_000)
    store = TieredStore([host], FINGERPRINT, clock=FakeClock())
    host.broken = True
    assert store.save("a", blob(10, seed=1)) == 0
    assert store.load("a") is None
    assert not store.contains_all(["a"])
    assert store.longest_joint_prefix(["a"], ["b"]) == 0


def test_stats_are_plain_numbers(host_and_disk):
    store, _, _ = host_and_disk
    store.save("a", blob(100, seed=1))
    store.load("a")
    stats = store.stats()
    assert set(stats) == {"host", "disk"}
    for row in stats.values():
        assert all(isinstance(value, int | float) for value in row.values())
        assert {"hits", "misses", "stored_bytes", "loaded_bytes", "evictions", "corrupt_objects", "failures",
                "store_seconds_sum", "store_count", "load_seconds_sum", "load_count", "used_bytes",
                "capacity_bytes", "degraded"} <= set(row)


def test_tier_names_must_differ():
    with pytest.raises(ValueError, match="distinct names"):
        TieredStore([HostTier(10), HostTier(10)], FINGERPRINT)
