"""The trace replay with the offload tier: prefixes a tiny HBM evicted come back from the tier (up to
the oracle when it is big enough, never below HBM only when it is tiny), nothing leaks, a 0-byte tier
is exactly the replay without one, and the tier's objects have the 48B shape's sizes."""

from __future__ import annotations

import json
import statistics

import pytest

from deltaserve.bench.cache_sim import compare_tier_loaded, main, run_cache_sim
from deltaserve.bench.cache_sim_tier import (
    ClairvoyantTierIndex,
    parse_tier_sizes,
    prompt_block_uses,
    tier_object_bytes,
)
from deltaserve.offload.objects import rank_object_bytes

MiB, GiB = 1 << 20, 1 << 30
# (hash_ids, input_length); every request has output_length 4. Each 7-block prompt fills an
# 8-block HBM, evicting what came before it.
TRACE = [
    ([1, 2, 3], 1536),
    ([10, 11, 12, 13, 14, 15, 16], 3584),
    ([1, 2, 3, 4], 2048),  # [1, 2, 3]: 1536
    ([10, 11, 12, 13, 14, 15, 17], 3400),  # [10..15]: 3072
    ([1, 2, 3, 4, 5], 2500),  # [1, 2, 3, 4]: 2048
    ([20, 21, 22, 23, 24, 25, 26], 3584),
    ([10, 11, 12, 13, 14, 15, 17], 3500),  # the fourth's 6 full blocks: 3072
]
ORACLE_TOKENS = 1536 + 3072 + 2048 + 3072
# kv_blocks, checkpoint_units, checkpoint_interval, concurrency
SERIAL = dict(kv_blocks=8, checkpoint_units=2, checkpoint_interval=512, concurrency=1)
CONCURRENT = dict(kv_blocks=10, checkpoint_units=3, checkpoint_interval=1024, concurrency=2)  # with preemptions


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as f:
        for i, (hash_ids, input_length) in enumerate(TRACE):
            f.write(json.dumps({"timestamp": i, "input_length": input_length, "output_length": 4,
                                "hash_ids": hash_ids}) + "\n")
    return str(path)


def assert_nothing_leaked(r: dict, kv_blocks: int, concurrency: int) -> None:
    assert r["kv_free_blocks_at_end"] == kv_blocks
    assert r["state_slots_free_at_end"] == 2 * concurrency


def test_a_big_tier_brings_back_what_hbm_evicted(trace_path):
    hbm = run_cache_sim(trace_path, **SERIAL)
    tier = run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB)
    assert hbm["oracle_hit_tokens"] == tier["oracle_hit_tokens"] == ORACLE_TOKENS
    assert hbm["hit_tokens"] == 0  # two checkpoint units and 8 blocks keep nothing across a 7-block prompt
    assert tier["hit_tokens"] == ORACLE_TOKENS and tier["hit_over_oracle"] == 1.0
    # one request at a time: the same schedule, so every token the tier added is the whole difference
    assert tier["tier_hit_tokens"] == tier["hit_tokens"] - hbm["hit_tokens"]
    assert tier["tier_loads"] == 4 and tier["tier_saves_skipped"] == 0
    assert tier["tier_index"]["used_bytes"] <= GiB
    for r in (hbm, tier):
        assert_nothing_leaked(r, SERIAL["kv_blocks"], SERIAL["concurrency"])


def test_time_to_first_token_in_replay_units(trace_path):
    """Steps and tokens computed from a request's arrival to its first token; the tier-loaded requests
    against the same requests without the tier (a load waits a step, and saves the recompute)."""
    rows = [run_cache_sim(trace_path, **SERIAL), run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB)]
    compare_tier_loaded(rows)
    hbm, tier = rows
    # a cold 1,536-token prompt files 3 checkpoints (rungs at 512 and 1,024, its prompt-end anchor) into
    # 2 units: a chunk ending at the second, then the rest; 1,536 tokens computed, all its own
    assert hbm["first_token_at"]["r0"] == tier["first_token_at"]["r0"] == [2, 1536]
    assert hbm["ttft_steps"]["median"] == statistics.median(steps for steps, _ in hbm["first_token_at"].values())
    assert "tier_loaded_ttft" not in hbm and tier["tier_loaded_requests"] == ["r2", "r3", "r4", "r6"]
    loaded = tier["tier_loaded_ttft"]
    assert loaded["requests"] == tier["tier_loads"] == 4
    assert loaded["computed_tokens_with"] < loaded["computed_tokens_without"]
    assert tier["computed_tokens"] < hbm["computed_tokens"]


def test_concurrent_requests_with_preemptions(trace_path):
    hbm = run_cache_sim(trace_path, **CONCURRENT)
    tier = run_cache_sim(trace_path, **CONCURRENT, tier_bytes=GiB)
    assert hbm["num_preemptions"] > 0
    assert hbm["hit_tokens"] < tier["hit_tokens"] <= tier["oracle_hit_tokens"]
    assert tier["tier_loads"] > 0
    for r in (hbm, tier):
        assert_nothing_leaked(r, CONCURRENT["kv_blocks"], CONCURRENT["concurrency"])


@pytest.mark.parametrize("config", [SERIAL, CONCURRENT], ids=["serial", "concurrent"])
def test_a_tier_of_one_image_never_hits_less(trace_path, config):
    kv_chunk_bytes, image_bytes = tier_object_bytes(512)
    hbm = run_cache_sim(trace_path, **config)
    tiny = run_cache_sim(trace_path, **config, tier_bytes=kv_chunk_bytes + image_bytes)
    assert tiny["hit_tokens"] >= hbm["hit_tokens"]
    assert tiny["tier_index"]["used_bytes"] <= kv_chunk_bytes + image_bytes
    assert_nothing_leaked(tiny, config["kv_blocks"], config["concurrency"])


@pytest.mark.parametrize("config", [SERIAL, CONCURRENT], ids=["serial", "concurrent"])
def test_a_zero_byte_tier_is_the_replay_without_one(trace_path, config):
    """Every number of the replay, as without a tier (the pinned figures of the commit that added the tier
    went when checkpoints began to be captured inside chunks, which changed the schedule)."""
    keys = ("hit_tokens", "kv_hit_tokens_all_admissions", "tokens_lost_to_missing_checkpoint", "checkpoints_filed",
            "checkpoints_evicted", "num_preemptions", "num_steps", "oracle_hit_tokens")
    plain = run_cache_sim(trace_path, **config)
    r = run_cache_sim(trace_path, **config, tier_bytes=0)
    assert {k: r[k] for k in keys} == {k: plain[k] for k in keys}
    assert r["oracle_hit_tokens"] == ORACLE_TOKENS and r["num_drain_steps"] == 0
    assert r["tier_index"] is None and r["tier_loads"] == r["tier_saves_done"] == r["tier_hit_tokens"] == 0


def test_object_sizes_are_the_48b_shape():
    # 7 MLA layers x 576 latents x 2 bytes a token; 20 KDA layers x (conv 3 x 4096 x 3 x 2 + recurrent 32 x 128^2 x 4)
    assert tier_object_bytes(512) == (rank_object_bytes(512 * 8064), rank_object_bytes(43_417_600))
    assert tier_object_bytes(1024)[0] == rank_object_bytes(1024 * 8064)


def test_flags(trace_path, capsys):
    assert parse_tier_sizes("0,64GiB, 256GiB") == [0, 64 * GiB, 256 * GiB]
    rows = main(["--trace", trace_path, "--kv-blocks", "8", "--checkpoint-units", "2", "--intervals", "512",
                 "--concurrency", "1", "--tier-bytes", "0,1GiB", "--tier-max-pending-saves", "3"])
    assert [r["tier_bytes"] for r in rows] == [0, GiB] and rows[1]["tier_max_pending_saves"] == 3
    lines = capsys.readouterr().out.strip().splitlines()
    assert "ideal and lossless" in lines[1]
    assert lines[-4].split()[:4] == ["kv_blocks", "ckpt_units", "interval", "tier"]
    assert lines[-2].split()[:4] == ["8", "2", "512", "1GiB"]
    assert lines[-1].startswith("kv_blocks=8 interval=512 tier=1GiB: 4 tier-loaded requests, median time to first")
    assert "first_token_at" not in rows[0] and "tier_loaded_requests" not in rows[1]
    assert rows[1]["tier_loaded_ttft"]["requests"] == 4
    with pytest.raises(ValueError, match="multiple of the checkpoint grid"):  # chunk 1024: the grid is 1024
        run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB, tier_chunk_tokens=1024)
    with pytest.raises(ValueError, match="tier-chunk-tokens=700"):
        run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB, tier_chunk_tokens=700)
    with pytest.raises(ValueError, match="cannot hold one KV chunk"):
        run_cache_sim(trace_path, **SERIAL, tier_bytes=MiB)


def test_clairvoyant_index_evicts_the_object_read_last():
    # a, b, c, d: block hashes; requests 0..5 read them as below (d never again)
    uses = prompt_block_uses([[b"a"], [b"b"], [b"c"], [b"a", b"b"], [b"c"], [b"b"]])
    index = ClairvoyantTierIndex(30, 512, 512, 10, 10, uses=uses)  # room for three objects
    for h in (b"a", b"b", b"c"):
        index.add_kv(h)
    index.add_kv(b"d")  # never read: the first to go, however recent
    assert [index.has_kv(h) for h in (b"a", b"b", b"c", b"d")] == [True, True, True, False]
    index.advance(4)  # requests 0-3 looked up: a is never read again, b next at 5, c at 4
    index.add_state(b"b")
    assert not index.has_kv(b"a") and index.has_kv(b"b") and index.has_kv(b"c") and index.has_state(b"b")
    index.advance(5)  # c's last reader has looked up
    index.add_kv(b"e")
    assert not index.has_kv(b"c") and index.has_kv(b"b") and index.has_state(b"b")
    assert index.used_bytes == 30 and index.stats.kv_evictions == 3


def test_clairvoyant_eviction_on_the_small_trace(trace_path):
    """With room for 4 images and 16 chunks, LRU keeps nothing a later prompt reads (each prompt's rung
    images push out the earlier ones) and the clairvoyant index keeps 4,096 tokens of hits. Not an
    exact optimum: at 8 images and 8 chunks LRU hits 5,120 tokens against its 4,608."""
    kv_chunk, image = tier_object_bytes(512)
    size = 4 * image + 16 * kv_chunk
    lru = run_cache_sim(trace_path, **SERIAL, tier_bytes=size)
    bound = run_cache_sim(trace_path, **SERIAL, tier_bytes=size, tier_eviction="clairvoyant")
    assert bound["tier_eviction"] == "clairvoyant" and lru["tier_eviction"] == "lru"
    assert (lru["hit_tokens"], bound["hit_tokens"]) == (0, 4096)
    assert_nothing_leaked(bound, SERIAL["kv_blocks"], SERIAL["concurrency"])
    with pytest.raises(ValueError, match="tier_eviction"):
        run_cache_sim(trace_path, **SERIAL, tier_bytes=size, tier_eviction="lfu")


def test_continuing_admission_saves_only_what_a_later_prompt_extends(trace_path):
    """`--tier-admission continuing` hints the requests a later prompt extends (holds their last full
    block): the 1st, 3rd and 4th of the small trace. The 2nd is not (the 4th branches from it, its last
    block edited), so the 4th's 3,072-token hit on it is lost; the others' hits stay, the tier stores
    less, and nothing leaks."""
    every = run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB)
    hinted = run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB, tier_admission="continuing")
    assert hinted["tier_admission"] == "continuing" and every["tier_admission"] == "all"
    assert every["hit_tokens"] == ORACLE_TOKENS and hinted["hit_tokens"] == ORACLE_TOKENS - 3072
    assert hinted["tier_saves_done"] < every["tier_saves_done"]
    assert hinted["tier_index"]["used_bytes"] < every["tier_index"]["used_bytes"]
    assert_nothing_leaked(hinted, SERIAL["kv_blocks"], SERIAL["concurrency"])
    with pytest.raises(ValueError, match="tier_admission"):
        run_cache_sim(trace_path, **SERIAL, tier_bytes=GiB, tier_admission="some")
