"""GET /metrics parses with prometheus_client, and its series move as requests are served."""

from __future__ import annotations

import time

from entrypoints.server import scrape

EXPECTED = [
    "deltaserve:num_requests_running", "deltaserve:num_requests_waiting", "deltaserve:kv_cache_usage_perc",
    "deltaserve:prompt_tokens_total", "deltaserve:generation_tokens_total",
    "deltaserve:prefix_cache_queries_total", "deltaserve:prefix_cache_hits_total",
    "deltaserve:time_to_first_token_seconds_count", "deltaserve:inter_token_latency_seconds_count",
    "deltaserve:e2e_request_latency_seconds_count", "deltaserve:request_queue_time_seconds_count",
    "deltaserve:request_prompt_tokens_count", "deltaserve:request_generation_tokens_count",
    "deltaserve:state_checkpoints", "deltaserve:state_checkpoint_usage_perc", "deltaserve:num_preemptions_total",
]


def test_metrics_parse_and_move(server):
    with server.client() as client:
        before = scrape(client)
        for name in EXPECTED:
            assert name in before, name
        prompt = "Metrics are counted per request, and this prompt repeats. " * 4
        for _ in range(2):
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
            assert response.status_code == 200
        usage = response.json()["usage"]
        after = scrape(client)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("deltaserve:generation_tokens_total") == 10
    assert moved("deltaserve:prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert moved("deltaserve:request_success_total{finished_reason=length}") == 2
    assert moved("deltaserve:time_to_first_token_seconds_count") == 2
    assert moved("deltaserve:inter_token_latency_seconds_count") == 8
    assert moved("deltaserve:e2e_request_latency_seconds_count") == 2
    assert moved("deltaserve:request_generation_tokens_sum") == 10
    assert moved("deltaserve:prefix_cache_queries_total") >= 2 * usage["prompt_tokens"]
    assert moved("deltaserve:prefix_cache_hits_total") >= usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert after["deltaserve:state_checkpoints"] >= 1
    assert moved("deltaserve:state_checkpoints_filed_total{kind=prompt_end}") >= 1


def test_periodic_stats_line_while_busy(server):
    with server.client() as client:
        client.post("/v1/completions", json={"prompt": "busy", "max_tokens": 40, "ignore_eos": True})
    deadline = time.monotonic() + 5
    while "generation throughput" not in server.log and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in server.log.splitlines() if "generation throughput" in line)
    assert "KV cache usage" in line and "prefix cache hit rate" in line and "running:" in line
