"""The transfer engines move bytes between two real processes on loopback, for each installed backend.

Per backend, one peer process (spawned once per module) registers a region of seeded random bytes;
this process registers a region poisoned with 0xAB. Reads pull ranges of different sizes and
offsets, among them 512 descriptors of 64 bytes; writes push the other way, from either side. Every
check compares the bytes that landed with the source and that the bytes around them stayed as they
were. A read from a peer that has exited must raise TransferError, not hang.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kv_transfer import BACKENDS, TransferError, available_backends, make_agent
from deltaserve.kv_transfer.loopback_peer import LoopbackPeer

REGION_BYTES = 2 << 20
POISON = 0xAB
TIMEOUT_S = 20.0
AVAILABLE = available_backends()


def backend_param(backend: str):
    reason = f"{backend} library not importable; install with: {BACKENDS[backend].install}"
    return pytest.param(backend, marks=pytest.mark.skipif(backend not in AVAILABLE, reason=reason))


@pytest.fixture(scope="module", params=[backend_param(b) for b in BACKENDS])
def pair(request):
    """(backend, local agent, its poisoned region, the peer process, the peer's name here)."""
    backend = request.param
    region = torch.full((REGION_BYTES,), POISON, dtype=torch.uint8)
    agent = make_agent(backend, f"test-{backend}")
    agent.register([(region.data_ptr(), REGION_BYTES)])
    peer = LoopbackPeer(backend, REGION_BYTES, name=f"peer-{backend}")
    try:
        peer_name = agent.add_peer(peer.metadata)
        yield backend, agent, region, peer, peer_name
    finally:
        peer.close()
        agent.close()


def read_ranges() -> list[tuple[int, int, int]]:
    """(local_offset, remote_offset, nbytes): one large, one odd-sized at odd offsets, 512 x 64 B."""
    ranges = [(0, 0, 1 << 20), ((1 << 20) + 3, 12_345, 100_003)]
    ranges += [((1 << 20) + 200_000 + 64 * i, 1_500_000 + 192 * i + 5, 64) for i in range(512)]
    return ranges


def expect_landed(region: torch.Tensor, source: torch.Tensor, ranges: list[tuple[int, int, int]]) -> None:
    """Each range's bytes equal the source's; every byte outside the ranges is still the poison."""
    touched = torch.zeros(region.numel(), dtype=torch.bool)
    for i, (local, remote, nbytes) in enumerate(ranges):
        assert torch.equal(region[local : local + nbytes], source[remote : remote + nbytes]), f"range {i} differs"
        touched[local : local + nbytes] = True
    assert bool((region[~touched] == POISON).all()), "bytes outside the transferred ranges changed"


def test_read_pulls_ranges_of_many_sizes(pair):
    _, agent, region, peer, peer_name = pair
    region.fill_(POISON)
    ranges = read_ranges()
    ops = [(region.data_ptr() + local, peer.region_addr + remote, n) for local, remote, n in ranges]
    handle = agent.read(peer_name, ops)
    agent.wait(handle, TIMEOUT_S)
    assert agent.poll(handle), "poll of a finished transfer stays True"
    expect_landed(region, peer.expected, ranges)


def test_write_pushes_ranges_into_peer(pair):
    _, agent, region, peer, peer_name = pair
    region.copy_(torch.randint(0, 256, (REGION_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    # the only test that changes the peer's bytes: onto ranges no other test reads
    ranges = [(0, 1_750_000, 300_000), (400_001, 1_196_700, 4096)]
    ranges += [(600_000 + 64 * i, 1_200_800 + 128 * i, 64) for i in range(512)]
    ops = [(region.data_ptr() + local, peer.region_addr + remote, n) for local, remote, n in ranges]
    agent.wait(agent.write(peer_name, ops), TIMEOUT_S)
    for i, (local, remote, nbytes) in enumerate(ranges):
        landed = torch.frombuffer(bytearray(peer.read_region(remote, nbytes)), dtype=torch.uint8)
        assert torch.equal(landed, region[local : local + nbytes]), f"range {i} differs at the peer"
    gap = torch.frombuffer(bytearray(peer.read_region(2_050_000, 1000)), dtype=torch.uint8)
    assert torch.equal(gap, peer.expected[2_050_000:2_051_000]), "peer bytes beyond the pushed range changed"


def test_peer_pushes_into_this_process(pair):
    backend, agent, region, peer, _ = pair
    region.fill_(POISON)
    name_of_us = peer.add_peer(agent.metadata())
    # (our offset, peer offset, nbytes)
    ranges = [(5000, 1_000_001, 65_536 * 3 + 1)] + [(1_000_000 + 64 * i, 1_600_000 + 256 * i, 64) for i in range(512)]
    peer.push(name_of_us, [(peer.region_addr + src, region.data_ptr() + dst, n) for dst, src, n in ranges])
    expect_landed(region, peer.expected, ranges)


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_read_from_exited_peer_raises(backend):
    region = torch.full((1 << 16,), POISON, dtype=torch.uint8)
    peer = LoopbackPeer(backend, 1 << 16, name=f"doomed-{backend}")
    with make_agent(backend, f"survivor-{backend}") as agent, peer:
        agent.register([(region.data_ptr(), region.numel())])
        peer_name = agent.add_peer(peer.metadata)
        ops = [(region.data_ptr(), peer.region_addr, 4096)]
        agent.wait(agent.read(peer_name, ops), TIMEOUT_S)  # connected and working first
        peer.exit_abruptly()
        assert not peer.process.is_alive()
        with pytest.raises(TransferError, match=peer_name):
            agent.wait(agent.read(peer_name, ops * 8), TIMEOUT_S)


def test_make_agent_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown"):
        make_agent("rdma-over-pigeons", "x")


def test_ops_are_validated_before_posting(pair):
    backend, agent, region, peer, peer_name = pair
    with pytest.raises(ValueError, match="empty"):
        agent.read(peer_name, [])
    with pytest.raises(ValueError, match="nbytes"):
        agent.read(peer_name, [(region.data_ptr(), peer.region_addr, 0)])
    with pytest.raises(ValueError, match="unknown"):
        agent.read("no-such-peer", [(region.data_ptr(), peer.region_addr, 8)])
