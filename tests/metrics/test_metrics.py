"""The Prometheus series and the periodic log line, fed with plain step statistics (no server)."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from deltaserve.engine.core import FinishedRequestStats, IterationStats
from deltaserve.metrics.prometheus import EngineMetrics, _token_buckets
from deltaserve.metrics.stats_logger import StatsLogger


def _snapshot(running=1, waiting=2, queried=100, hits=40, filed_rung=3, preemptions=0) -> dict:
    return {
        "scheduler": {"num_running": running, "num_waiting": waiting, "num_preemptions": preemptions,
                      "computed_tokens": 0},
        "kv_cache": {"usage": 0.25},
        "state_slots": {"num_slots": 8, "num_free": 6},
        "prefix_cache": {"queried_tokens": queried, "hit_tokens": hits},
        "checkpoints": {"num_checkpoints": 5, "num_pinned": 1, "capacity": 10,
                        "filed": {"rung": filed_rung, "prompt_end": 1}, "evicted": {"rung": 0}},
    }


def _values(metrics: EngineMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def test_running_totals_become_increments_and_gauges_follow_the_snapshot():
    m = EngineMetrics("tiny", max_model_len=1000)
    stats = IterationStats(num_prompt_tokens=7, num_generation_tokens=2, num_computed_tokens=9,
                           time_to_first_tokens=[0.1], inter_token_latencies=[0.02],
                           finished=[FinishedRequestStats("length", 1.5, 0.01, 7, 4, 0)])
    m.record(stats, _snapshot())
    m.record(IterationStats(), _snapshot(running=0, waiting=0, queried=150, hits=90, filed_rung=4))
    v = _values(m)
    assert v["deltaserve:prompt_tokens_total"] == 7 and v["deltaserve:generation_tokens_total"] == 2
    assert v["deltaserve:prefix_cache_queries_total"] == 150 and v["deltaserve:prefix_cache_hits_total"] == 90
    assert v["deltaserve:state_checkpoints_filed_total{kind=rung}"] == 4
    assert v["deltaserve:num_requests_running"] == 0 and v["deltaserve:kv_cache_usage_perc"] == 0.25
    assert v["deltaserve:state_slot_usage_perc"] == 0.25 and v["deltaserve:state_checkpoints_pinned"] == 1
    assert v["deltaserve:request_success_total{finished_reason=length}"] == 1
    assert v["deltaserve:time_to_first_token_seconds_count"] == 1
    assert v["deltaserve:e2e_request_latency_seconds_sum"] == 1.5


def test_offload_tier_series_per_tier():
    m = EngineMetrics("tiny", max_model_len=1000)
    tiers = {"host": {"hits": 3, "misses": 1, "stored_bytes": 100, "loaded_bytes": 60, "evictions": 0,
                      "corrupt_objects": 0, "failures": 0, "store_seconds_sum": 0.5, "store_count": 4,
                      "load_seconds_sum": 0.1, "load_count": 4, "degraded": 0},
             "disk": {"hits": 1, "corrupt_objects": 2, "failures": 1, "degraded": 1}}
    offload = {"loads_done": 4, "loads_failed": 1, "loaded_tokens": 512, "hit_tokens": 640, "saves_done": 6,
               "saves_skipped": 2,
               "tiers": tiers}
    m.record(None, {**_snapshot(), "offload": offload})
    v = _values(m)
    assert v["deltaserve:offload_tier_hits_total{tier=host}"] == 3
    assert v["deltaserve:offload_tier_hits_total{tier=disk}"] == 1
    assert v["deltaserve:offload_tier_corrupt_objects_total{tier=disk}"] == 2
    assert v["deltaserve:offload_tier_load_seconds_total{tier=host}"] == 0.1
    assert v["deltaserve:offload_tier_load_calls_total{tier=host}"] == 4
    assert v["deltaserve:offload_tier_degraded{tier=disk}"] == 1
    assert v["deltaserve:offload_loads_total"] == 4 and v["deltaserve:offload_saves_skipped_total"] == 2
    assert v["deltaserve:offload_loaded_tokens_total"] == 512 and v["deltaserve:offload_hit_tokens_total"] == 640


def test_token_buckets_stop_at_the_context():
    assert _token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_stats_line_only_while_busy(caplog):
    logger = StatsLogger(interval_s=5.0)
    logger.record(IterationStats(num_generation_tokens=10, num_computed_tokens=60))
    assert logger.maybe_log(_snapshot(), now=logger._start + 1) is None  # too soon
    with caplog.at_level(logging.INFO, logger="deltaserve.engine"):
        line = logger.maybe_log(_snapshot(), now=logger._start + 5)
    assert "prompt throughput: 10.0 tokens/s" in line and "generation throughput: 2.0 tokens/s" in line
    assert "prefix cache hit rate: 40.0%" in line and "state checkpoints: 5/10" in line
    assert line in caplog.text
    idle = _snapshot(running=0, waiting=0)
    assert logger.maybe_log(idle, now=logger._start + 10) is None  # nothing happened since


def test_spec_decode_series_and_log_line(caplog):
    m = EngineMetrics("tiny", max_model_len=1000)
    spec = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12, "accepted_per_position": [7, 4, 1],
            "acceptance_rate": 0.4, "mean_acceptance_length": 2.2}
    m.record(None, {**_snapshot(), "spec_decode": spec})
    v = _values(m)
    assert v["deltaserve:spec_decode_num_drafts_total"] == 10
    assert v["deltaserve:spec_decode_num_draft_tokens_total"] == 30
    assert v["deltaserve:spec_decode_num_accepted_tokens_total"] == 12
    assert v["deltaserve:spec_decode_num_accepted_tokens_per_pos_total{position=1}"] == 4
    logger = StatsLogger(interval_s=5.0)
    logger.record(IterationStats(num_generation_tokens=3, num_computed_tokens=5))
    with caplog.at_level(logging.INFO, logger="deltaserve.engine"):
        line = logger.maybe_log({**_snapshot(), "spec_decode": spec}, now=logger._start + 5)
    assert "acceptance rate 40.0%" in line and "mean acceptance length 2.20" in line
