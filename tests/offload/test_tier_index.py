"""The scheduler's index of the offload tier: joint hits on the chunk grid past what HBM holds, LRU
eviction by the largest stage's bytes, and forgetting what a load found missing."""

from __future__ import annotations

import pytest

from deltaserve.core.block_hash import append_block_hashes
from deltaserve.offload.tier_index import TierIndex

BLOCK, CHUNK = 4, 16  # 4 blocks per chunk


def hashes(num_tokens: int, seed: int = 0) -> list[bytes]:
    return append_block_hashes([], [seed * 1000 + t for t in range(num_tokens)], BLOCK)


def index(capacity: int = 10_000, kv: int = 100, image: int = 300) -> TierIndex:
    return TierIndex(capacity, CHUNK, BLOCK, kv, image)


def store(idx: TierIndex, block_hashes: list[bytes], chunks: int, states: list[int]) -> None:
    chunk_hashes = idx.chunk_hashes(block_hashes)
    for h in chunk_hashes[:chunks]:
        idx.add_kv(h)
    for n in states:
        idx.add_state(chunk_hashes[n - 1])


def test_the_longest_joint_hit_needs_every_kv_chunk_and_a_state_at_its_end():
    idx, h = index(), hashes(70)  # 4 whole chunks, 70 tokens
    store(idx, h, chunks=4, states=[1, 3])
    hit = idx.lookup(h, 70, hbm_hit_tokens=0)
    assert hit is not None and hit.num_tokens == 48 and hit.start_tokens == 0
    assert hit.kv_chunk_hashes == idx.chunk_hashes(h)[:3] and hit.state_hash == idx.chunk_hashes(h)[2]
    idx.forget("kv", idx.chunk_hashes(h)[1])  # a hole in the KV: only the first chunk's state serves
    assert idx.lookup(h, 70, 0).num_tokens == 16


def test_a_hit_is_worth_it_only_past_hbm_and_never_covers_the_last_token():
    idx, h = index(), hashes(64)
    store(idx, h, chunks=4, states=[2, 4])
    hit = idx.lookup(h, 64, hbm_hit_tokens=20)  # HBM holds 20 tokens: the load starts at chunk 1
    assert hit.num_tokens == 32 and hit.start_tokens == 16 and len(hit.kv_chunk_hashes) == 1
    assert idx.lookup(h, 64, hbm_hit_tokens=32) is None  # the chunk-4 image would cover token 63
    assert idx.lookup(h, 65, hbm_hit_tokens=32).num_tokens == 64


def test_eviction_charges_the_largest_stage_and_drops_the_least_recent():
    idx = index(capacity=800, kv=100, image=300)  # room for 2 chunks and 2 images
    a, b = hashes(40, 1), hashes(40, 2)
    store(idx, a, chunks=1, states=[1])
    store(idx, b, chunks=1, states=[1])
    assert idx.used_bytes == 800 and idx.lookup(a, 40, 0).num_tokens == 16  # touches a: b is now older
    store(idx, hashes(40, 3), chunks=1, states=[])  # one more chunk: b's chunk goes
    assert idx.lookup(b, 40, 0) is None and idx.lookup(a, 40, 0) is not None
    assert idx.stats.kv_evictions == 1 and idx.used_bytes <= 800


def test_refusals_name_the_sizes():
    with pytest.raises(ValueError, match="multiple of the block size 4"):
        TierIndex(10_000, 10, BLOCK, 100, 300)
    with pytest.raises(ValueError, match="cannot hold one KV chunk"):
        TierIndex(350, CHUNK, BLOCK, 100, 300)
