"""The trace replay on a tiny synthetic trace with known sharing: exact oracle numbers, a large
cache reaching the oracle, a coarse checkpoint interval losing exactly the hits it should, nothing leaked."""

from __future__ import annotations

import json

import pytest

from deltaserve.bench.cache_sim import main, oracle_hit_tokens, prompt_token_ids, read_trace, run_cache_sim

# (hash_ids, input_length); every request has output_length 4
TRACE = [
    ([1, 2, 3], 1536),  # three full blocks
    ([1, 2, 4], 1400),  # shares [1, 2]; its block 4 is partial, so never reusable
    ([1, 2, 3, 5], 2048),  # shares [1, 2, 3] with the first
    ([6], 300),
    ([1, 2, 4, 7], 2000),  # [1, 2] only: the second request's block 4 was partial
    ([9, 2], 1024),  # block 2 under another parent is another block
]
ORACLE = [0, 1024, 1536, 0, 1024, 0]


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as f:
        for i, (hash_ids, input_length) in enumerate(TRACE):
            f.write(
                json.dumps({"timestamp": i, "input_length": input_length, "output_length": 4, "hash_ids": hash_ids})
            )
            f.write("\n")
    return str(path)


def test_prompt_tokens_follow_hash_ids(trace_path):
    records = read_trace(trace_path)
    a, b, c = (prompt_token_ids(r) for r in records[:3])
    assert len(a) == 1536 and len(b) == 1400
    assert a[:1024] == b[:1024] and a[1024:1536] != b[1024:1400]
    assert c[:1536] == a and len(set(a)) == 1536


def test_oracle_is_exact(trace_path):
    assert oracle_hit_tokens(read_trace(trace_path)) == ORACLE


def test_large_cache_reaches_the_oracle_and_frees_everything(trace_path):
    r = run_cache_sim(trace_path, kv_blocks=1000, checkpoint_units=100, checkpoint_interval=512, concurrency=1)
    assert r["queried_tokens"] == sum(n for _, n in TRACE)
    assert r["oracle_hit_tokens"] == sum(ORACLE) == r["hit_tokens"]
    assert r["hit_over_oracle"] == 1.0 and r["tokens_lost_to_missing_checkpoint"] == 0
    assert r["kv_free_blocks_at_end"] == 1000 and r["state_slots_free_at_end"] == 2


def test_coarse_interval_loses_the_hit_without_a_checkpoint(trace_path):
    r = run_cache_sim(trace_path, kv_blocks=1000, checkpoint_units=100, checkpoint_interval=2048, concurrency=1)
    # the second request finds KV [0, 1024) but no checkpoint there (only the first's prompt end at
    # 1536); its own prompt end (1024) is the checkpoint the fifth request then hits. Five prompt
    # ends (the 300-token prompt has none); the 2048-token prompt ends on the rung, filed as prompt end
    assert r["hit_tokens"] == 1536 + 1024 and r["tokens_lost_to_missing_checkpoint"] == 1024
    assert r["checkpoints_filed"] == {"rung": 0, "prompt_end": 5, "end_of_sequence": 0, "demand": 0}
    assert r["kv_free_blocks_at_end"] == 1000


def test_main_prints_the_table_last(trace_path, capsys):
    rows = main(["--trace", trace_path, "--kv-blocks", "100,1000", "--intervals", "512,2048", "--max-requests", "4"])
    assert len(rows) == 4 and all(r["num_requests"] == 4 for r in rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-5].split()[:3] == ["kv_blocks", "ckpt_units", "interval"]
    assert lines[-1].split()[:3] == ["1000", "125", "2048"]


@pytest.mark.parametrize("flags,message", [
    (["--intervals", "0"], "--intervals=0: each must be a positive multiple"),
    (["--intervals", "2048,700"], "positive multiple of the trace's 512-token blocks"),
    (["--kv-blocks", "0"], "must be positive"),
])
def test_bad_grid_values_are_refused_naming_the_flag(trace_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["--trace", trace_path, "--max-requests", "2", *flags])
