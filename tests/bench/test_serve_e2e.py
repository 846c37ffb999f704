"""`deltaserve bench serve` end to end against a real tiny server on loopback: each workload writes
JSON whose counts and token totals are exactly those of its requests; over-long requests are
counted as failures; --plot writes the charts."""

from __future__ import annotations

import itertools
import json

import pytest

from deltaserve.bench.serve.agentic import AgenticConfig, AgenticWorkload
from deltaserve.bench.serve.runner import split_evenly
from deltaserve.bench.serve.workloads import RandomConfig, RandomWorkload
from deltaserve.cli import main

VOCAB, MAX_MODEL_LEN = 512, 1024  # the tiny server's (tests/bench/conftest.py)


def _bench(server, tmp_path, *args: str) -> dict:
    out = tmp_path / "results.json"
    code = main(["bench", "serve", "--base-url", server.url, "--no-progress", "--out", str(out), *args])
    assert code == 0
    return json.loads(out.read_text())


def _check_level(level: dict, num_requests: int, input_tokens: int, output_tokens: int, num_gpus: int = 1) -> None:
    assert (level["num_sent"], level["completed"], level["failed"], level["cancelled"]) == (num_requests,) * 2 + (0, 0)
    assert (level["input_tokens"], level["output_tokens"]) == (input_tokens, output_tokens)
    assert level["output_tokens_counted_from"] == "usage" and level["output_len_mismatches"] == 0
    assert level["output_token_ids_returned"] == num_requests
    assert level["prefix_cache"]["usage_prompt_tokens"] == input_tokens  # the server counted what was sent
    assert level["prefix_cache"]["metrics_queried_tokens"] == input_tokens
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert 0 < level[key]["median"] <= level[key]["p99"]
    assert level["output_tokens_per_s_per_gpu"] == pytest.approx(level["output_tokens_per_s"] / num_gpus)


def test_random_workload_exact_totals_and_plots(tiny_server, tmp_path, capsys):
    plots = tmp_path / "plots"
    doc = _bench(tiny_server, tmp_path, "--workload", "random", "--concurrency", "1,2", "--num-requests", "3",
                 "--random-input-len", "64", "--random-output-len", "8", "--random-range-ratio", "0.5",
                 "--seed", "4", "--num-gpus", "2", "--plot", str(plots), "--save-requests")
    assert doc["config"]["vocab_size"] == VOCAB and doc["config"]["max_model_len"] == MAX_MODEL_LEN
    assert doc["config"]["model"] == "deltaserve-tiny" and not doc["interrupted"]
    assert doc["environment"]["date"] and doc["server"]["version"]
    workload = RandomWorkload(RandomConfig(64, 8, 0.5), VOCAB, 4, 0, None)
    for level_index, level in enumerate(doc["levels"]):
        specs = list(itertools.islice(workload.requests(level_index), 3))
        _check_level(level, 3, sum(len(s.prompt_token_ids) for s in specs), sum(s.max_tokens for s in specs), 2)
        saved = sorted(level["requests"], key=lambda r: r["index"])  # --save-requests
        assert [(r["prompt_len"], r["output_tokens"]) for r in saved] == [
            (len(s.prompt_token_ids), s.max_tokens) for s in specs]
    assert [level["concurrency"] for level in doc["levels"]] == [1, 2]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["C", "done", "fail"] and [line.split()[0] for line in table[1:3]] == ["1", "2"]
    for name in ("ttft.png", "throughput_per_gpu.png", "hit_rate.png", "summary.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_requests_beyond_the_context_are_counted_not_fatal(tiny_server, tmp_path):
    # --max-model-len lets the client send prompts of 400..1200 tokens + 16 to a 1024-token server
    args = ["--workload", "random", "--concurrency", "2", "--num-requests", "8", "--random-input-len", "800",
            "--random-output-len", "16", "--random-range-ratio", "0.5", "--max-model-len", "4096"]
    doc = _bench(tiny_server, tmp_path, *args)
    specs = list(itertools.islice(RandomWorkload(RandomConfig(800, 16, 0.5), VOCAB, 0, 0, None).requests(0), 8))
    too_long = [s for s in specs if len(s.prompt_token_ids) + s.max_tokens > MAX_MODEL_LEN]
    assert 0 < len(too_long) < 8  # seed 0 draws some of each
    level = doc["levels"][0]
    assert (level["completed"], level["failed"]) == (8 - len(too_long), len(too_long))
    assert level["input_tokens"] == sum(len(s.prompt_token_ids) for s in specs if s not in too_long)
    assert sum(e["count"] for e in level["errors"]) == len(too_long)
    # too long for any room (the processor's words) or too long with max_tokens (the server's)
    assert all(e["message"].startswith("HTTP 400: ") and ("max_model_len=1024" in e["message"] or
               "maximum context length is 1024" in e["message"]) for e in level["errors"])


TRACE = [  # (timestamp ms, input_length, hash_ids); output_length 8 each
    (0, 600, [1, 2]),
    (10, 700, [1, 2]),  # the first's 600 tokens: 37 full 16-token blocks (the 38th holds its output)
    (20, 1000, [3, 4]),
    (30, 400, [3]),  # 400 tokens of block 3, less its last token: 24 blocks
    (40, 2000, [5, 6, 7, 8]),  # longer than the server's context: skipped
    (50, 900, [1, 9]),  # block 1: 32 blocks
]
TRACE_ORACLE = 37 * 16 + 24 * 16 + 32 * 16


@pytest.mark.parametrize("replay", ["concurrency", "timestamps"])
def test_trace_replay_shares_what_the_trace_shares(tiny_server, tmp_path, replay):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 8, "hash_ids": ids}) + "\n"
                            for t, n, ids in TRACE))
    doc = _bench(tiny_server, tmp_path, "--workload", "trace", "--trace", str(path), "--trace-replay", replay,
                 "--trace-time-scale", "0.1", "--concurrency", "1", "--num-requests", "10")
    assert doc["workload"]["num_skipped_too_long"] == 1 and doc["workload"]["num_records"] == 5
    level = doc["levels"][0]
    _check_level(level, 5, 600 + 700 + 1000 + 400 + 900, 5 * 8)
    cache = level["prefix_cache"]
    assert cache["oracle_hit_tokens"] == TRACE_ORACLE and cache["oracle_block_size"] == 16
    assert 0 < cache["usage_cached_tokens"] <= TRACE_ORACLE
    assert cache["metrics_hit_tokens"] == cache["usage_cached_tokens"]


def _expected_agentic(workload: AgenticWorkload, level: int, concurrency: int, num_requests: int) -> list:
    """The (prompt length, max_tokens) of every request the runner sends: slot i runs sessions
    i, i + C, ... until its share of num_requests is spent (answers do not change lengths)."""
    expected = []
    for slot, quota in enumerate(split_evenly(num_requests, concurrency)):
        sent = 0
        for k in itertools.count():
            if sent >= quota:
                break
            session = workload.session(level, slot + k * concurrency)
            while sent < quota and (spec := session.next_request()) is not None:
                expected.append((len(spec.prompt_token_ids), spec.max_tokens))
                sent += 1
                session.add_turn(None, spec.max_tokens)
                session.think_time()
    return expected


def test_agentic_sessions_exact_totals_and_reuse(tiny_server, tmp_path):
    config = AgenticConfig(system_prompt_len=200, tool_definitions_len=100, user_prompt_len=50,
                           tool_result_len=(30, 60), answer_len=(8, 16), target_context_len=700,
                           think_time_s=(0.01, 0.01))
    args = ["--workload", "agentic", "--concurrency", "1,2", "--num-requests", "8", "--agentic-system-len", "200",
            "--agentic-tools-len", "100", "--agentic-user-len", "50", "--agentic-tool-result-len", "30:60",
            "--agentic-answer-len", "8:16", "--agentic-target-context", "700", "--agentic-think-time", "0.01",
            "--num-gpus", "2"]
    doc = _bench(tiny_server, tmp_path, *args)
    workload = AgenticWorkload(config, VOCAB, 0, 0, MAX_MODEL_LEN)
    for level_index, (level, concurrency) in enumerate(zip(doc["levels"], (1, 2), strict=True)):
        expected = _expected_agentic(workload, level_index, concurrency, 8)
        _check_level(level, 8, sum(n for n, _ in expected), sum(m for _, m in expected), 2)
        assert level["workload_stats"]["answers_from_server"] == 8
        cache = level["prefix_cache"]
        assert 0.3 < cache["usage_hit_rate"] <= cache["oracle_hit_rate"]  # each turn reuses the last
        assert cache["metrics_hit_tokens"] == cache["usage_cached_tokens"]
    assert doc["levels"][1]["workload_stats"]["sessions_started"] >= 2
