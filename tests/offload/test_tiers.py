"""HostTier and DiskTier: round trips, LRU eviction by bytes, and the disk index rebuilt on start."""

import os

import pytest

from deltaserve.offload.disk_tier import DiskTier
from deltaserve.offload.tiers import HostTier, LruIndex, TierError
from offload.damage import blob


@pytest.fixture(params=["host", "disk"])
def make_tier(request, tmp_path):
    def make(capacity_bytes: int):
        if request.param == "host":
            return HostTier(capacity_bytes)
        return DiskTier(tmp_path / "offload", capacity_bytes)

    return make


def test_round_trip_and_stats(make_tier):
    tier = make_tier(10_000)
    data = blob(1234, seed=1)
    assert tier.put("a", data)
    assert tier.contains("a") and not tier.contains("b")
    assert tier.get("a") == data
    assert tier.get("b") is None
    assert tier.used_bytes == 1234 and tier.capacity_bytes == 10_000
    stats = tier.stats.as_dict()
    assert (stats["hits"], stats["misses"], stats["stores"]) == (1, 1, 1)
    assert (stats["stored_bytes"], stats["loaded_bytes"]) == (1234, 1234)
    assert (stats["store_count"], stats["load_count"]) == (1, 2)
    assert tier.delete("a") and not tier.delete("a")
    assert tier.get("a") is None and tier.used_bytes == 0


def test_lru_eviction_by_bytes(make_tier):
    tier = make_tier(1000)
    for key, nbytes in (("a", 300), ("b", 300), ("c", 300)):
        assert tier.put(key, blob(nbytes, seed=nbytes + ord(key)))
    assert tier.get("a") is not None  # a is now the most recently used; b the least
    assert tier.put("d", blob(350, seed=4))  # needs 250 more bytes: b goes
    assert [k for k in "abcd" if tier.contains(k)] == ["a", "c", "d"]
    assert tier.put("e", blob(600, seed=5))  # 50 free, needs 550 more: c then a go (d came after a's hit)
    assert [k for k in "abcde" if tier.contains(k)] == ["d", "e"]
    assert tier.used_bytes == 350 + 600
    assert tier.stats.evictions == 3 and tier.stats.evicted_bytes == 900


def test_object_larger_than_the_tier_is_rejected_without_evicting(make_tier):
    tier = make_tier(1000)
    assert tier.put("a", blob(600, seed=1))
    assert not tier.put("huge", blob(1001, seed=2))
    assert tier.contains("a") and not tier.contains("huge")
    assert tier.stats.rejected_stores == 1 and tier.stats.evictions == 0


def test_put_of_a_held_key_refreshes_recency_only(make_tier):
    tier = make_tier(1000)
    tier.put("a", blob(400, seed=1))
    tier.put("b", blob(400, seed=2))
    assert tier.put("a", blob(400, seed=1))
    tier.put("c", blob(400, seed=3))  # b is the least recently used now
    assert [k for k in "abc" if tier.contains(k)] == ["a", "c"]
    assert tier.stats.stores == 4 and tier.used_bytes == 800


def test_lru_index_victims():
    index = LruIndex(100)
    for key, nbytes in (("x", 40), ("y", 30), ("z", 20)):
        index.add(key, nbytes)
    assert index.victims_for(10) == []
    assert index.victims_for(30) == ["x"]
    assert index.victims_for(100) == ["x", "y", "z"]
    assert index.victims_for(101) is None


def test_disk_index_is_rebuilt_in_access_order(tmp_path):
    root = tmp_path / "offload"
    tier = DiskTier(root, 1000)
    for i, key in enumerate("abc"):
        tier.put(key, blob(300, seed=i))
    # Access order a (oldest write) touched last: b, c, a. Mtimes are set explicitly so the test
    # does not depend on the file system's timestamp resolution.
    for age, key in ((3, "b"), (2, "c"), (1, "a")):
        path = tier.path_of(key)
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age))
    (tier.path_of("a").parent / "leftover.123.456.tmp").write_bytes(b"half an object")
    tier.close()

    reopened = DiskTier(root, 1000)
    assert reopened.used_bytes == 900
    assert reopened.get("a") == blob(300, seed=0)
    assert not any(path.name.endswith(".tmp") for path in root.rglob("*"))
    reopened.put("d", blob(300, seed=9))  # b is the oldest
    assert [k for k in "abcd" if reopened.contains(k)] == ["a", "c", "d"]


def test_disk_rebuild_trims_to_a_smaller_cap(tmp_path):
    root = tmp_path / "offload"
    tier = DiskTier(root, 1000)
    for i, key in enumerate("abc"):
        tier.put(key, blob(300, seed=i))
        path = tier.path_of(key)
        os.utime(path, (path.stat().st_atime, 1_000_000 + i))
    smaller = DiskTier(root, 650)
    assert [k for k in "abc" if smaller.contains(k)] == ["b", "c"]
    assert smaller.used_bytes == 600 and smaller.stats.evictions == 1
    assert not tier.path_of("a").exists()


def test_disk_file_removed_behind_the_tier_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path / "offload", 1000)
    tier.put("a", blob(100, seed=1))
    tier.path_of("a").unlink()
    assert tier.get("a") is None
    assert not tier.contains("a") and tier.used_bytes == 0


def test_disk_write_failure_raises_tier_error_and_leaves_no_trace(tmp_path):
    tier = DiskTier(tmp_path / "offload", 1000)
    # A directory where the object's fan-out directory should be: the write fails like a broken disk.
    fanout = tier.path_of("a").parent
    fanout.parent.mkdir(parents=True, exist_ok=True)
    fanout.write_bytes(b"not a directory")
    with pytest.raises(TierError, match="disk tier: put"):
        tier.put("a", blob(100, seed=1))
    assert tier.stats.failures == 1
    assert not tier.contains("a") and tier.used_bytes == 0
