"""MooncakeStoreTier against a real mooncake_master over TCP, started and stopped by this module.

Skipped when the Mooncake Store client or the master binary is missing. The module runs one master
for the plain tests (one process group, killed at teardown); the outage test runs its own master,
kills it mid-run and brings it back on the same port.
"""

import time

import pytest

from deltaserve.offload.mooncake_tier import MooncakeStoreTier, parse_master_address
from deltaserve.offload.objects import encode
from deltaserve.offload.tiered_store import TieredStore
from deltaserve.offload.tiers import HostTier, TierError
from offload.damage import DAMAGES, FINGERPRINT, blob, damaged_object
from offload.mooncake_master import MASTER_BINARY, Master, free_port

store_module = pytest.importorskip("mooncake.store", reason="Mooncake Store client not installed")
RECOVERY_TIMEOUT_S = 30.0


pytestmark = pytest.mark.skipif(MASTER_BINARY is None, reason="mooncake_master binary not found")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    running = Master(tmp_path_factory.mktemp("mooncake") / "master.log")
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def remote(master):
    """One store client for the module's plain tests (closing a client takes a second or two)."""
    tier = MooncakeStoreTier(master.url, segment_bytes=32 << 20)
    yield tier
    tier.close()


def test_round_trip(remote, request):
    key = request.node.name
    data = encode(blob(100_000, seed=1), FINGERPRINT)
    assert not remote.contains(key) and remote.get(key) is None
    assert remote.put(key, data)
    assert remote.contains(key)
    assert remote.get(key) == data
    assert remote.contains_many([key, key + "-absent"]) == [True, False]
    assert remote.delete(key) and not remote.contains(key)
    assert remote.stats.hits == 1 and remote.stats.misses == 1 and remote.stats.failures == 0
    assert remote.used_bytes is None and remote.capacity_bytes is None


def test_object_larger_than_the_store_is_not_stored(remote, request):
    assert not remote.put(request.node.name, blob(64 << 20, seed=2))
    assert not remote.contains(request.node.name)


@pytest.mark.parametrize("damage", DAMAGES)
def test_bad_object_in_the_store_is_counted_dropped_and_missed(remote, request, damage):
    key = request.node.name
    assert remote.put(key, damaged_object(blob(5000, seed=3), damage))
    host = HostTier(1 << 20)
    store = TieredStore([host, remote], FINGERPRINT)
    corrupt_before = remote.stats.corrupt_objects

    assert store.load(key) is None
    assert remote.stats.corrupt_objects == corrupt_before + 1
    assert not remote.contains(key) and not host.contains(key)


def test_promotion_from_the_store_and_sharing_between_engines(master, remote, request):
    key = request.node.name
    data = blob(20_000, seed=5)
    writer = TieredStore([HostTier(1 << 20, name="host")], FINGERPRINT)
    writer_host = writer.tiers[0]
    reader_host = HostTier(1 << 20)
    reader = TieredStore([reader_host, remote], FINGERPRINT)
    assert remote.put(key, encode(data, FINGERPRINT))  # as another engine's save would
    assert not writer_host.contains(key)
    assert reader.load(key) == data
    assert reader_host.contains(key)
    assert reader.load(key) == data
    assert reader_host.stats.hits == 1 and remote.stats.hits >= 1


def test_bad_master_address_is_refused():
    with pytest.raises(ValueError, match="mooncake://MASTER_HOST:RPC_PORT"):
        parse_master_address("mooncake://no-port")
    assert parse_master_address("mooncake://10.0.0.1:50051") == "10.0.0.1:50051"


def test_stopped_master_degrades_to_the_tiers_left(tmp_path):
    master = Master(tmp_path / "master.log")
    master.start()
    clock_now = [0.0]
    store = None
    try:
        host = HostTier(1 << 20)
        remote = MooncakeStoreTier(master.url, segment_bytes=16 << 20, name="mooncake")
        store = TieredStore([host, remote], FINGERPRINT, retry_after_s=5, clock=lambda: clock_now[0])
        saved = {f"k{i}": blob(3000, seed=i) for i in range(3)}
        for key, data in saved.items():
            assert store.save(key, data) == 2

        master.stop()
        assert store.save("k3", blob(3000, seed=3)) == 1  # host only; the failed put degrades the store tier
        assert store.degraded_tiers() == ["mooncake"]
        failures = remote.stats.failures
        for key, data in saved.items():
            assert store.load(key) == data
        assert store.load("k-absent") is None
        assert store.contains_all(list(saved))
        assert remote.stats.failures == failures == 1  # skipped, not retried, while the backoff runs

        # The master comes back on the same port; the client remounts its segment within a second or
        # two. Each probe after the backoff either fails (backoff doubles) or finds the tier healthy.
        master.start()
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while store.degraded_tiers() or not remote.contains("k4"):
            if time.monotonic() > deadline:
                pytest.fail(f"the store tier did not recover: {store.stats()['mooncake']}")
            clock_now[0] += 600
            store.save("k4", blob(3000, seed=4))
            time.sleep(0.1)
        assert store.stats()["mooncake"]["outages"] == 1
        host.delete("k4")
        assert store.load("k4") == blob(3000, seed=4)
    finally:
        if store is not None:
            store.close()
        master.stop()


def test_unreachable_master_at_start_raises_tier_error():
    with pytest.raises(TierError, match="mooncake_master running"):
        MooncakeStoreTier(f"mooncake://127.0.0.1:{free_port()}")
