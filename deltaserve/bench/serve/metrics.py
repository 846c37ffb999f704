"""Pure functions from request records to the numbers of one concurrency level.

Definitions (those of `vllm bench serve` where it has them):
  - TTFT: send -> first token chunk. ITL: the gap between consecutive token chunks, one sample per
    chunk after the first (a chunk may carry several tokens). TPOT: (e2e - TTFT) / (output tokens - 1),
    per request with at least two. E2E: send -> last token chunk.
  - Distributions: mean, median, P90, P99 in milliseconds (numpy's linear interpolation).
  - Throughput: completed requests and their tokens over the level's duration (first send to last
    end); input tokens are those sent, output tokens the server's usage count when it gives one.
    Per GPU: divided by num_gpus.
  - Prefix-cache hit rate, three ways: from usage, sum(cached_tokens) / sum(prompt_tokens) over completed
    requests that report cached_tokens; from /metrics, the increase of the hits counter over that of
    the queries counter across the level (as the server counts them, failures included); the oracle,
    what an infinite cache with blocks of `oracle_block_size` tokens could serve of the completed
    prompts: for each in send order, the longest leading run of its full blocks (never its last token)
    that is a leading run of full blocks of the prompt + output of an earlier one, over their input tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from deltaserve.bench.prefix_oracle import InfinitePrefixCache
from deltaserve.bench.serve.client import PrefixCacheCounters
from deltaserve.bench.serve.records import RequestRecord

MAX_ERROR_KINDS = 20  # distinct error messages listed per level; the rest are summed as "(other)"


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90 and p99 of seconds, in milliseconds; all None when there are no values."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def error_counts(records: Sequence[RequestRecord]) -> list[dict]:
    """Distinct error messages with their counts, most frequent first."""
    counts = Counter(r.error for r in records if r.error is not None)
    common = counts.most_common(MAX_ERROR_KINDS)
    listed = [{"message": message, "count": count} for message, count in common]
    rest = sum(counts.values()) - sum(count for _, count in common)
    if rest:
        listed.append({"message": "(other)", "count": rest})
    return listed


def oracle_hit_tokens(records: Sequence[RequestRecord], block_size: int) -> int:
    """Tokens an infinite cache of `block_size`-token blocks could serve (see the module docstring).
    Each record's `block_keys` are those of its prompt + output, in that block size."""
    cache = InfinitePrefixCache()
    hit = 0
    for r in sorted(records, key=lambda r: r.send_time):
        hit += cache.hit_tokens(r.block_keys, r.prompt_len, block_size)
        cache.insert(r.block_keys)
    return hit


def usage_hit(records: Sequence[RequestRecord]) -> tuple[int, int] | None:
    """(sum of cached_tokens, sum of prompt_tokens) over the records whose usage reports cached_tokens."""
    reporting = [r.usage for r in records if r.usage is not None and r.usage.cached_tokens is not None]
    if not reporting:
        return None
    return sum(u.cached_tokens for u in reporting), sum(u.prompt_tokens for u in reporting)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize_level(concurrency: int, records: Sequence[RequestRecord], duration_s: float, num_gpus: int,
                    oracle_block_size: int, counters: tuple[PrefixCacheCounters | None,
                                                        PrefixCacheCounters | None] = (None, None)) -> dict:
    """Everything measured at one level, as plain data (the JSON entry of the level).

    counters: the server's prefix-cache counters before and after the level, where it has them.
    """
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    counted = [r.output_tokens for r in done]
    output_tokens = sum(n for n, _ in counted)
    sources = sorted({source for _, source in counted})
    total_tokens = input_tokens + output_tokens

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    def per_gpu(x: float | None) -> float | None:
        return None if x is None else x / num_gpus

    throughput = {
        "request_throughput": per_s(len(done)),
        "input_tokens_per_s": per_s(input_tokens),
        "output_tokens_per_s": per_s(output_tokens),
        "total_tokens_per_s": per_s(total_tokens),
    }
    for key in ("input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        throughput[key + "_per_gpu"] = per_gpu(throughput[key])

    usage = usage_hit(done)
    before, after = counters
    metrics_hit = None
    if before is not None and after is not None:
        queried, hits = after.queries - before.queries, after.hits - before.hits
        metrics_hit = {"metrics_hit_rate": _ratio(hits, queried), "metrics_queried_tokens": queried,
                       "metrics_hit_tokens": hits, "metrics_counter": after.metric}
        if after.tier_hits is not None:  # deltaserve's offload tier: its share of the hit, objects per tier
            tier = after.tier_hits - (before.tier_hits or 0.0)
            metrics_hit.update(tier_hit_tokens=tier, tier_hit_rate=_ratio(tier, queried),
                               hbm_hit_rate=_ratio(hits - tier, queried),
                               tier_object_hits={name: n - (before.tier_object_hits or {}).get(name, 0.0)
                                                 for name, n in (after.tier_object_hits or {}).items()})
    oracle = oracle_hit_tokens(done, oracle_block_size)
    prefix_cache = {
        "usage_hit_rate": None if usage is None else _ratio(usage[0], usage[1]),
        "usage_cached_tokens": None if usage is None else usage[0],
        "usage_prompt_tokens": None if usage is None else usage[1],
        "metrics_hit_rate": None, "metrics_queried_tokens": None, "metrics_hit_tokens": None,
        "metrics_counter": None, "tier_hit_tokens": None, "tier_hit_rate": None, "hbm_hit_rate": None,
        "tier_object_hits": None,
        **(metrics_hit or {}),
        "oracle_hit_rate": _ratio(oracle, input_tokens),
        "oracle_hit_tokens": oracle,
        "oracle_block_size": oracle_block_size,
    }
    return {
        "concurrency": concurrency,
        "num_sent": len(records),
        "completed": len(done),
        "failed": sum(1 for r in records if r.error is not None and not r.cancelled),
        "cancelled": sum(1 for r in records if r.cancelled),
        "errors": error_counts([r for r in records if not r.cancelled]),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": total_tokens,
        "output_tokens_counted_from": sources[0] if len(sources) == 1 else ("mixed" if sources else None),
        "output_len_mismatches": sum(1 for r, (n, _) in zip(done, counted, strict=True) if n != r.max_tokens),
        "output_token_ids_returned": sum(1 for r in done if r.output_token_ids is not None),
        **throughput,
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": distribution_ms([r.e2e_latency for r in done if r.e2e_latency is not None]),
        "prefix_cache": prefix_cache,
    }
