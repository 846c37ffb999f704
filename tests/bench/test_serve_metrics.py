"""The benchmark's numbers on hand-made records: TTFT, ITL, TPOT, E2E, percentiles, throughput per
GPU, the three hit rates, error counts; and the table and the Prometheus counters parser."""

from __future__ import annotations

import pytest

from deltaserve.bench.prefix_oracle import InfinitePrefixCache, block_keys
from deltaserve.bench.serve.client import PrefixCacheCounters, parse_prefix_cache_counters, root_url
from deltaserve.bench.serve.metrics import distribution_ms, oracle_hit_tokens, summarize_level
from deltaserve.bench.serve.records import RequestRecord, Usage
from deltaserve.bench.serve.report import format_table


def _record(index, send, chunks, *, prompt_len=100, max_tokens=4, usage=None, error=None, ids=None, end=None):
    r = RequestRecord(index, prompt_len, max_tokens, send_time=send, chunk_times=list(chunks), usage=usage,
                      error=error, output_token_ids=ids)
    r.end_time = end if end is not None else (chunks[-1] if chunks else send)
    return r


def test_one_request_timings():
    # sent at 10.0; token chunks at 10.5, 10.6, 10.8, 11.1 (four chunks of one token each)
    r = _record(0, 10.0, [10.5, 10.6, 10.8, 11.1], usage=Usage(100, 4, 0))
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e_latency == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.output_tokens == (4, "usage")


def test_output_tokens_come_from_usage_then_ids_then_chunks():
    # two chunks carrying five ids: usage says 5, ids say 5, chunks alone would say 2
    assert _record(0, 0.0, [1.0, 2.0], usage=Usage(10, 5, None)).output_tokens == (5, "usage")
    assert _record(0, 0.0, [1.0, 2.0], ids=[1, 2, 3, 4, 5]).output_tokens == (5, "token_ids")
    assert _record(0, 0.0, [1.0, 2.0]).output_tokens == (2, "chunks")
    assert _record(0, 0.0, [1.0], usage=Usage(10, 1, None)).tpot is None  # one token: no TPOT


def test_distribution_is_numpy_linear_percentiles_in_ms():
    d = distribution_ms([0.001 * x for x in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5) and d["median"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01)
    assert distribution_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_level_summary_counts_throughput_per_gpu_and_hit_rates():
    records = [
        _record(0, 0.0, [0.2, 0.3, 0.4, 0.5], prompt_len=1000, usage=Usage(1000, 4, 0)),
        _record(1, 0.1, [0.5, 0.7, 0.9, 1.1], prompt_len=1000, usage=Usage(1000, 4, 600)),
        _record(2, 0.2, [], prompt_len=1000, error="HTTP 500: boom", end=0.3),
        _record(3, 0.3, [], prompt_len=1000, error="HTTP 500: boom", end=0.4),
        _record(4, 0.4, [], prompt_len=50, error="timeout (ReadTimeout)", end=2.0),
    ]
    cancelled = _record(5, 0.5, [0.9], prompt_len=10)
    cancelled.cancelled = True
    counters = (PrefixCacheCounters(5000, 1000, "deltaserve:prefix_cache_queries_total"),
                PrefixCacheCounters(9000, 2000, "deltaserve:prefix_cache_queries_total"))
    s = summarize_level(8, records + [cancelled], duration_s=2.0, num_gpus=4, oracle_block_size=16,
                        counters=counters)
    assert (s["num_sent"], s["completed"], s["failed"], s["cancelled"]) == (6, 2, 3, 1)
    assert s["errors"] == [{"message": "HTTP 500: boom", "count": 2}, {"message": "timeout (ReadTimeout)", "count": 1}]
    assert (s["input_tokens"], s["output_tokens"], s["total_tokens"]) == (2000, 8, 2008)
    assert s["output_tokens_counted_from"] == "usage" and s["output_len_mismatches"] == 0
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(4.0) and s["output_tokens_per_s_per_gpu"] == pytest.approx(1.0)
    assert s["total_tokens_per_s_per_gpu"] == pytest.approx(2008 / 2.0 / 4)
    assert s["ttft_ms"]["median"] == pytest.approx(300.0)  # 200 and 400 ms
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * (0.3 + 0.6) / 6)  # 0.1 x 3 and 0.2 x 3
    assert s["e2e_latency_ms"]["p90"] == pytest.approx(500 + 0.9 * 500)
    cache = s["prefix_cache"]
    assert cache["usage_hit_rate"] == pytest.approx(0.3) and cache["usage_cached_tokens"] == 600
    assert cache["metrics_hit_rate"] == pytest.approx(0.25) and cache["metrics_queried_tokens"] == 4000
    # no block keys on these records: the oracle finds nothing to share
    assert cache["oracle_hit_tokens"] == 0 and cache["oracle_hit_rate"] == 0.0


def test_hit_rates_are_none_when_the_server_reports_nothing():
    s = summarize_level(1, [_record(0, 0.0, [1.0, 2.0])], duration_s=2.0, num_gpus=1, oracle_block_size=16)
    assert s["prefix_cache"]["usage_hit_rate"] is None and s["prefix_cache"]["metrics_hit_rate"] is None
    assert s["output_tokens_counted_from"] == "chunks"
    empty = summarize_level(1, [], duration_s=0.0, num_gpus=1, oracle_block_size=16)
    assert empty["completed"] == 0 and empty["request_throughput"] is None and empty["ttft_ms"]["p99"] is None


def test_oracle_counts_leading_full_blocks_in_send_order_never_the_last_token():
    a = list(range(64))  # 4 blocks of 16
    b = a[:40] + [999] * 24  # shares 2 full blocks (and 8 tokens of a third) with a
    c = a  # all of a, but its last token must be computed: 3 blocks
    d = list(range(1000, 1020)) + a[:16]  # shares nothing at its start

    def rec(i, send, prompt, output=()):
        r = _record(i, send, [send + 1], prompt_len=len(prompt))
        r.block_keys = block_keys(list(prompt) + list(output), 16)
        return r

    records = [rec(2, 2.0, c), rec(0, 0.0, a), rec(1, 1.0, b), rec(3, 3.0, d)]
    assert oracle_hit_tokens(records, 16) == 0 + 32 + 48 + 0
    # an earlier request's output counts: e's prompt is a's prompt + output
    e_prompt = a + [7] * 16 + [8]
    assert oracle_hit_tokens([rec(0, 0.0, a, [7] * 16), rec(1, 1.0, e_prompt)], 16) == 80


def test_prefix_trie_matches_leading_runs_only():
    cache = InfinitePrefixCache()
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == 3 and cache.match([1, 2, 3], max_blocks=2) == 2
    assert cache.match([2, 3]) == 0  # a run not at the start is no prefix
    assert block_keys(list(range(40)), 16) == [hash(tuple(range(16))), hash(tuple(range(16, 32)))]


def test_prometheus_counters_of_deltaserve_and_vllm():
    text = ('# TYPE deltaserve:prefix_cache_queries counter\n'
            'deltaserve:prefix_cache_queries_total{model_name="m"} 300.0\n'
            '# TYPE deltaserve:prefix_cache_hits counter\n'
            'deltaserve:prefix_cache_hits_total{model_name="m"} 120.0\n')
    counters = parse_prefix_cache_counters(text)
    assert (counters.queries, counters.hits) == (300.0, 120.0)
    vllm = ('# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine="0"} 10\n'
            'vllm:prefix_cache_queries_total{engine="1"} 30\n'
            '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0"} 4\n')
    counters = parse_prefix_cache_counters(vllm)
    assert (counters.queries, counters.hits, counters.metric) == (40, 4, "vllm:prefix_cache_queries_total")
    assert parse_prefix_cache_counters("# TYPE other counter\nother_total 1\n") is None


def test_the_offload_tiers_share_of_the_hit():
    def exposition(queries, hits, tier, host, disk):
        def counter(name, value, labels='model_name="m"'):
            return f"# TYPE deltaserve:{name} counter\ndeltaserve:{name}_total{{{labels}}} {value}\n"

        return (counter("prefix_cache_queries", queries) + counter("prefix_cache_hits", hits)
                + counter("offload_hit_tokens", tier)
                + counter("offload_tier_hits", host, 'model_name="m",tier="host"')
                + f'deltaserve:offload_tier_hits_total{{model_name="m",tier="disk"}} {disk}\n')

    before = parse_prefix_cache_counters(exposition(100, 20, 0, 0, 0))
    after = parse_prefix_cache_counters(exposition(500, 320, 200, 9, 3))
    assert (after.tier_hits, after.tier_object_hits) == (200, {"host": 9, "disk": 3})
    level = summarize_level(4, [_record(0, 0.0, [0.5, 1.0], usage=Usage(100, 2, 50))], duration_s=1.0, num_gpus=1,
                            oracle_block_size=16, counters=(before, after))
    cache = level["prefix_cache"]
    assert (cache["metrics_hit_rate"], cache["tier_hit_rate"], cache["hbm_hit_rate"]) == (0.75, 0.5, 0.25)
    assert cache["tier_object_hits"] == {"host": 9, "disk": 3}
    assert "50.0%" in format_table([level]).splitlines()[1]


def test_root_url_and_table():
    assert root_url("http://h:8000/v1/") == root_url("http://h:8000") == "http://h:8000"
    level = summarize_level(4, [_record(0, 0.0, [0.5, 1.0], usage=Usage(100, 2, 50))], duration_s=1.0,
                            num_gpus=1, oracle_block_size=16)
    header, row = format_table([level]).splitlines()
    assert header.split()[:3] == ["C", "done", "fail"] and row.split()[:3] == ["4", "1", "0"]
    assert len(header) == len(row) and "50.0%" in row and row.split()[-3:-1] == ["-", "-"]  # no /metrics
