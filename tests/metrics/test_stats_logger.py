"""The three prefix-cache hit rates agree under preemption: the periodic log line, /metrics and the
requests' usage (`num_cached_tokens` over prompt tokens), on the real engine with the random tiny model.

Each request counts once, at its first admission, as in vLLM. A request that is preempted is admitted
again with its prompt + output so far; counting that as a new query made the log line and /metrics
report a fraction of what usage did whenever a small cache thrashed.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve import LLM
from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import MLALatentSpec
from deltaserve.core.prefix_cache import PrefixCache, PrefixHit
from deltaserve.core.request import Request
from deltaserve.engine.core import EngineCore, EngineCoreRequest
from deltaserve.metrics.prometheus import EngineMetrics
from deltaserve.metrics.stats_logger import StatsLogger
from deltaserve.sampling_params import SamplingParams

MAX_TOKENS = 40


def _counter(metrics: EngineMetrics, name: str) -> float:
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def _run_turns(core: EngineCore, metrics: EngineMetrics, logger: StatsLogger,
               num_sessions: int = 8, num_turns: int = 3) -> tuple[int, int]:
    """Multi-turn sessions sharing a system prompt, stepped as the engine-core process steps them;
    returns (sum of num_cached_tokens, sum of prompt tokens) over the finished requests."""
    rng = random.Random(0)
    system = [rng.randrange(3, 300) for _ in range(300)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(50)] for _ in range(num_sessions)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cached = queried = 0
    for turn in range(num_turns):
        answers: dict[str, list[int]] = {}
        for s, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"{turn}-{s}", list(prompt), params, MAX_TOKENS))
        while core.has_unfinished_requests():
            outputs, stats = core.step()
            metrics.record_step(stats)
            logger.record(stats)
            for out in outputs:
                answers.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    cached += out.num_cached_tokens
        queried += sum(len(p) for p in prompts)
        prompts = [p + answers[f"{turn}-{s}"] + [rng.randrange(3, 300) for _ in range(20)]
                   for s, p in enumerate(prompts)]
    return cached, queried


@pytest.fixture(scope="module")
def thrashing_run():
    """A KV cache of 60 blocks for 8 sessions of about 400 tokens: requests are preempted."""
    llm = LLM(model="random:tiny", dtype="float32", device="cpu", block_size=16, max_model_len=2048,
              max_num_batched_tokens=256, num_kv_blocks=60)
    core = llm.llm_engine.core
    metrics = EngineMetrics("tiny", core.max_model_len)
    logger = StatsLogger(interval_s=3600.0)
    cached, queried = _run_turns(core, metrics, logger)
    snapshot = core.get_metrics()
    metrics.record_snapshot(snapshot)
    line = logger.maybe_log(snapshot, now=logger._start + 2 * logger.interval_s)  # one line for the whole run
    return snapshot, metrics, line, cached, queried


def test_log_line_metrics_and_usage_agree_under_preemption(thrashing_run):
    snapshot, metrics, line, cached, queried = thrashing_run
    assert snapshot["scheduler"]["num_preemptions"] > 0 and 0 < cached < queried
    prefix = snapshot["prefix_cache"]
    assert (prefix["hit_tokens"], prefix["queried_tokens"]) == (cached, queried)
    assert _counter(metrics, "deltaserve:prefix_cache_hits_total") == cached
    assert _counter(metrics, "deltaserve:prefix_cache_queries_total") == queried
    assert f"prefix cache hit rate: {100 * cached / queried:.1f}%" in line


def test_readmissions_are_counted_apart(thrashing_run):
    snapshot, *_ = thrashing_run
    prefix = snapshot["prefix_cache"]
    assert prefix["queries"] == 8 * 3
    assert prefix["preempted_queries"] >= snapshot["scheduler"]["num_preemptions"] > 0
    assert prefix["preempted_queried_tokens"] > 0


def test_account_counts_a_request_once_at_first_admission():
    hit = PrefixHit(num_tokens=32, block_ids=[0, 1], checkpoint=None, num_kv_hit_tokens=48)
    pc = PrefixCache(KVCacheManager(MLALatentSpec(16, 1, 8, 2), 8, enable_prefix_caching=True),
                     CheckpointPool(2, unit_bytes=64, image_bytes=64), 64)
    request = Request("r", list(range(3, 53)), max_tokens=8)
    pc.account(request, hit)
    request.output_token_ids.extend([7, 7])
    request.num_preemptions = 1
    pc.account(request, hit)
    s = pc.stats
    assert (s.queries, s.queried_tokens, s.hit_tokens) == (1, 50, 32)
    assert (s.preempted_queries, s.preempted_queried_tokens, s.preempted_hit_tokens) == (1, 52, 32)
    assert (s.kv_hit_tokens, s.tokens_lost_to_missing_checkpoint) == (96, 32)
