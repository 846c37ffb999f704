"""Replay a Mooncake trace through the real scheduler and prefix cache, with no model.

Each trace record names its prompt as 512-token blocks (`hash_ids`; equal ids are equal blocks).
The simulator synthesizes the prompt's token ids from those ids (block i is
`[hash_ids[i] * 512 + j for j in range(512)]`, so equal ids give equal tokens and different ids
disjoint ones), truncated to `input_length`, and drives `Scheduler` + `KVCacheManager` +
`CheckpointPool` + `PrefixCache` step by step, feeding one fixed sampled token per sampled chunk.

Choices, stated in the output:
  - block_size is 512, so a trace block is one KV block;
  - one checkpoint is one unit (the image is unit-sized), so `checkpoint_units` is a checkpoint count;
  - max_tokens = min(output_length, max_output_tokens) to keep runs short;
  - arrivals follow trace order under a concurrency limit: each request is added, then steps run
    until at most `concurrency` requests are in flight (waiting + running). Timestamps only order
    the requests; reuse therefore depends on order and cache size, not on a guessed step time.

The oracle is an infinite cache: for each request the longest leading run of its hash_ids that
is a leading run of the full blocks of any earlier request, never covering its last token.

With `--tier-bytes` each configuration also runs with the offload tier (deltaserve/offload/): the
real OffloadScheduler and TierIndex beside the Scheduler, a host tier of that many bytes behind HBM
(cache_sim_tier.py: objects sized for the 48B shape, every save and load done in the step that
orders it, so the tier is ideal and lossless within its capacity). 0 is HBM only, the path without
the tier. A tier hit counts in the request's hit (`num_cached_tokens`) like an HBM hit, so hit% of
the tier rows is HBM + tier against the same oracle.

Time has no seconds here: `StepClock` counts each request's time to first token in steps and in
tokens computed meanwhile (a step's GPU time grows with its tokens), and a tier row compares its
tier-loaded requests with the same requests in the row without a tier (`compare_tier_loaded`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator, Sequence

from deltaserve.bench.cache_sim_tier import (
    MODEL_PRESET,
    build_offload,
    format_bytes,
    ideal_report,
    parse_tier_sizes,
    prompt_block_uses,
    tier_object_bytes,
    tier_results,
)
from deltaserve.bench.mooncake import TRACE_BLOCK_TOKENS, TraceRecord, read_trace
from deltaserve.bench.prefix_oracle import InfinitePrefixCache
from deltaserve.core.block_hash import extend_block_hashes
from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import MLALatentSpec
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.sampling_params import SamplingParams

SAMPLED_TOKEN = -1  # never a prompt token (prompt tokens are >= 0)
CACHE_CONTROL_HINT = SamplingParams(extra_args={"cache_control": {"type": "ephemeral"}})


def prompt_token_ids(record: TraceRecord) -> list[int]:
    """Token ids of the prompt: block i is derived from hash_ids[i] alone, truncated to input_length."""
    tokens: list[int] = []
    for h in record.hash_ids:
        base = h * TRACE_BLOCK_TOKENS
        tokens.extend(range(base, base + TRACE_BLOCK_TOKENS))
    return tokens[: record.input_length]


def oracle_hit_tokens(records: Sequence[TraceRecord]) -> list[int]:
    """Per request, the tokens an infinite block cache could skip: the longest leading run of its
    hash_ids equal to a leading run of full blocks of any earlier request, capped below its last token."""
    cache = InfinitePrefixCache()
    hits = []
    for r in records:
        hits.append(cache.hit_tokens(r.hash_ids, r.input_length, TRACE_BLOCK_TOKENS))
        cache.insert(r.hash_ids[: r.input_length // TRACE_BLOCK_TOKENS])
    return hits


def continues_later(uses: dict, hashes: Sequence, index: int) -> bool:
    """Whether a later prompt extends request `index`'s, whose full blocks hash to `hashes`: holds the
    hash of its last full block (`uses`: prompt_block_uses over the trace's prompts)."""
    return bool(hashes) and uses[hashes[-1]][-1] > index


class StepClock:
    """Time in the replay's own units: steps run, and tokens computed (every chunk's tokens, a proxy
    for a step's GPU time, which grows with the tokens it computes). Per request, the clock when it
    was added and when its first token was sampled: its time to first token in steps and in tokens
    computed meanwhile (its own and every other request's)."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.added: dict[str, tuple[int, int]] = {}
        self.first_token: dict[str, tuple[int, int]] = {}

    def add(self, request_id: str) -> None:
        self.added[request_id] = (self.steps, self.tokens)

    def tick(self, chunks: Sequence) -> None:
        """One step ran `chunks` (ScheduledChunk); those that sampled gave their request a token."""
        self.steps += 1
        self.tokens += sum(c.num_tokens for c in chunks)
        for c in chunks:
            if c.sample and c.request_id not in self.first_token:
                self.first_token[c.request_id] = (self.steps, self.tokens)

    def time_to_first_token(self) -> dict[str, list[int]]:
        """Each request that sampled -> [steps, tokens computed] from its arrival to the end of the step
        that sampled its first token (that step counted)."""
        return {rid: [steps - self.added[rid][0], tokens - self.added[rid][1]]
                for rid, (steps, tokens) in self.first_token.items()}


def _quantiles(values: Sequence[int]) -> dict[str, float]:
    """Median, p90 and mean (0 for none)."""
    if not values:
        return {"median": 0.0, "p90": 0.0, "mean": 0.0}
    ordered = sorted(values)
    return {"median": float(statistics.median(ordered)), "p90": float(ordered[int(0.9 * (len(ordered) - 1))]),
            "mean": statistics.fmean(ordered)}


def _steps(scheduler: Scheduler, clock: StepClock) -> Iterator[None]:
    """Run one scheduler step per iteration; every sampled chunk gets SAMPLED_TOKEN, and every tier
    save and load the step orders is reported done with it. A step that only saves checkpoints or
    moves tier objects is progress too (a tier load, or the end-of-sequence saves drained at the end)."""
    while True:
        out = scheduler.schedule()
        meta = out.offload_metadata
        if not (out.chunks or meta is not None or out.state_saves_before or scheduler.tier_waiting):
            raise RuntimeError(
                f"no progress with {scheduler.num_waiting} waiting and {scheduler.num_running} running: "
                "a request needs more KV blocks than kv_blocks; raise kv_blocks"
            )
        sampled = {c.request_id: SAMPLED_TOKEN for c in out.chunks if c.sample}
        scheduler.update_from_output(out, sampled, offload_output=ideal_report(meta))
        clock.tick(out.chunks)
        yield


def run_cache_sim(
    trace_path: str,
    kv_blocks: int,
    checkpoint_units: int,
    checkpoint_interval: int,
    max_requests: int | None = None,
    max_output_tokens: int = 64,
    concurrency: int = 64,
    max_num_batched_tokens: int = 16384,
    records: Sequence[TraceRecord] | None = None,
    tier_bytes: int = 0,
    tier_chunk_tokens: int = TRACE_BLOCK_TOKENS,
    tier_max_pending_saves: int = 2,
    tier_eviction: str = "lru",
    tier_admission: str = "all",
) -> dict:
    """Replay the trace through one cache configuration; returns its numbers as plain data.

    hit_tokens counts each request's hit at its first admission (re-admissions after a preemption
    are left out, so hit and oracle share the denominator queried_tokens = sum of input_length).
    tier_bytes > 0 adds the offload tier (chunks of tier_chunk_tokens; the checkpoint grid becomes
    lcm(512, 64, tier_chunk_tokens)); num_steps stops when the last request finishes, and the steps
    that then drain its end-of-sequence saves (into HBM units and the tier) are num_drain_steps.
    tier_eviction "clairvoyant" evicts by the trace's future (ClairvoyantTierIndex): a bound on what
    a better policy than the engine's LRU could reach, not a policy. tier_admission "continuing" runs
    the engine's cache_control admission with the hint on the requests a later prompt extends (a client
    that knows which conversations it will continue, as an agent loop does); "all" saves every request.
    """
    if records is None:
        records = read_trace(trace_path, max_requests)
    started = time.perf_counter()
    spec = MLALatentSpec(block_size=TRACE_BLOCK_TOKENS, num_layers=1, latent_dim=1, dtype_bytes=1)
    kv = KVCacheManager(spec, kv_blocks, enable_prefix_caching=True)
    checkpoints = CheckpointPool(checkpoint_units, unit_bytes=1, image_bytes=1)
    if tier_eviction not in ("lru", "clairvoyant"):
        raise ValueError(f"tier_eviction={tier_eviction!r}: lru or clairvoyant")
    if tier_admission not in ("all", "continuing"):
        raise ValueError(f"tier_admission={tier_admission!r}: all or continuing")
    clairvoyant_eviction = bool(tier_bytes) and tier_eviction == "clairvoyant"
    hint_continuing = bool(tier_bytes) and tier_admission == "continuing"
    # the trace's future, which both read: each prompt's full-block hashes, and where each hash recurs
    prompt_hashes = ([extend_block_hashes([], prompt_token_ids(r), TRACE_BLOCK_TOKENS) for r in records]
                     if clairvoyant_eviction or hint_continuing else [])
    uses = prompt_block_uses(prompt_hashes)
    offload = build_offload(tier_bytes, tier_chunk_tokens, tier_max_pending_saves,
                            uses if clairvoyant_eviction else None)
    clairvoyant = offload.index if clairvoyant_eviction and offload is not None else None
    prefix_cache = PrefixCache(kv, checkpoints, checkpoint_interval,
                               offload_chunk=tier_chunk_tokens if offload is not None else 1)
    max_len = max((r.input_length for r in records), default=0) + max_output_tokens + 1
    config = SchedulerConfig(
        max_num_seqs=concurrency, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
        offload_admission="cache_control" if hint_continuing else "all",
    )
    state_pool = StateSlotPool(2 * concurrency)
    scheduler = Scheduler(config, kv, state_pool, prefix_cache, offload=offload)
    clock = StepClock()
    steps = _steps(scheduler, clock)
    num_steps = 0
    requests: list[Request] = []
    looked_up = 0  # requests[:looked_up] have all been admitted once

    def step() -> None:
        nonlocal looked_up
        next(steps)
        if clairvoyant is not None:
            while looked_up < len(requests) and requests[looked_up].num_cached_tokens is not None:
                looked_up += 1
            clairvoyant.advance(looked_up)
    for i, r in enumerate(records):
        if spec.blocks_for(r.input_length + max_output_tokens) > kv_blocks:
            raise ValueError(
                f"kv_blocks={kv_blocks} cannot hold request {i} ({r.input_length} prompt tokens); raise kv_blocks"
            )
        request = Request(
            f"r{i}", prompt_token_ids(r), max_tokens=max(1, min(r.output_length, max_output_tokens)), arrival_index=i
        )
        if prompt_hashes:
            request.block_hashes = list(prompt_hashes[i])  # hashed already: the prefix cache extends them
        if hint_continuing and continues_later(uses, prompt_hashes[i], i):
            request.sampling_params = CACHE_CONTROL_HINT
        requests.append(request)
        scheduler.add_request(request)
        clock.add(request.request_id)
        while scheduler.num_running + scheduler.num_waiting + len(scheduler.tier_waiting) > concurrency:
            step()
            num_steps += 1
    while scheduler.has_unfinished_requests():
        step()
        num_steps += 1
    num_drain_steps = 0
    while scheduler.has_pending_saves:
        step()
        num_drain_steps += 1

    queried = sum(r.input_length for r in records)
    hit = sum(req.num_cached_tokens or 0 for req in requests)
    oracle = sum(oracle_hit_tokens(records))
    stats = prefix_cache.stats
    first_token_at = clock.time_to_first_token()
    return {
        "kv_blocks": kv_blocks,
        "checkpoint_units": checkpoint_units,
        "checkpoint_interval": checkpoint_interval,
        "num_requests": len(records),
        "max_output_tokens": max_output_tokens,
        "concurrency": concurrency,
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_rate": hit / queried if queried else 0.0,
        "oracle_hit_tokens": oracle,
        "oracle_hit_rate": oracle / queried if queried else 0.0,
        "hit_over_oracle": hit / oracle if oracle else 0.0,
        "kv_hit_tokens_all_admissions": stats.kv_hit_tokens,
        "tokens_lost_to_missing_checkpoint": stats.tokens_lost_to_missing_checkpoint,
        "checkpoints_filed": dict(checkpoints.stats.filed),
        "checkpoints_evicted": dict(checkpoints.stats.evicted),
        "checkpoints_declined_no_units": checkpoints.stats.declined_no_units,
        "num_preemptions": scheduler.num_preemptions_total,
        "num_steps": num_steps,
        "num_drain_steps": num_drain_steps,
        "computed_tokens": clock.tokens,
        "ttft_steps": _quantiles([steps for steps, _ in first_token_at.values()]),
        "ttft_computed_tokens": _quantiles([tokens for _, tokens in first_token_at.values()]),
        "first_token_at": first_token_at,
        "tier_loaded_requests": [req.request_id for req in requests if req.tier_hit_tokens],
        **tier_results(offload, tier_bytes, tier_chunk_tokens, tier_max_pending_saves),
        "tier_eviction": tier_eviction if tier_bytes else None,
        "tier_admission": tier_admission if tier_bytes else None,
        "kv_free_blocks_at_end": kv.num_free_blocks,
        "state_slots_free_at_end": state_pool.num_free,
        "seconds": time.perf_counter() - started,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def format_table(results: Sequence[dict]) -> str:
    """One row per configuration; filed/evicted columns are rung/prompt_end/end_of_sequence/demand;
    tier is the offload tier's bytes (0: HBM only); t_loads its loads, t_loaded the KV tokens they
    moved, t_hit the tokens they added past HBM's joint hit (a state image alone adds the KV HBM
    still held), all over every admission; skipped: the saves dropped at max_pending_saves; ttft_steps:
    the median of steps from a request's arrival to its first token, the step sampling it included.
    Then, per row with a tier, its tier-loaded requests' times against the same requests without it."""
    kinds = ("rung", "prompt_end", "end_of_sequence", "demand")
    header = (
        f"{'kv_blocks':>9} {'ckpt_units':>10} {'interval':>8} {'tier':>7} {'queried':>11} {'hit':>11} {'hit%':>6} "
        f"{'oracle%':>7} {'hit/orc':>7} {'t_loads':>7} {'t_loaded':>11} {'t_hit':>11} {'skipped':>7} "
        f"{'lost_ckpt':>10} {'filed r/p/e/d':>22} {'evicted r/p/e/d':>22} {'preempt':>7} {'ttft_steps':>10}"
    )
    lines = [header]
    for r in results:
        filed = "/".join(str(r["checkpoints_filed"][k]) for k in kinds)
        evicted = "/".join(str(r["checkpoints_evicted"][k]) for k in kinds)
        lines.append(
            f"{r['kv_blocks']:>9} {r['checkpoint_units']:>10} {r['checkpoint_interval']:>8} "
            f"{format_bytes(r['tier_bytes']):>7} {r['queried_tokens']:>11} {r['hit_tokens']:>11} "
            f"{100 * r['hit_rate']:>6.2f} {100 * r['oracle_hit_rate']:>7.2f} {r['hit_over_oracle']:>7.3f} "
            f"{r['tier_loads']:>7} {r['tier_loaded_tokens']:>11} {r['tier_hit_tokens']:>11} "
            f"{r['tier_saves_skipped']:>7} "
            f"{r['tokens_lost_to_missing_checkpoint']:>10} {filed:>22} {evicted:>22} {r['num_preemptions']:>7} "
            f"{r['ttft_steps']['median']:>10.1f}"
        )
    for r in results:
        if "tier_loaded_ttft" in r:
            t = r["tier_loaded_ttft"]
            lines.append(
                f"kv_blocks={r['kv_blocks']} interval={r['checkpoint_interval']} tier={format_bytes(r['tier_bytes'])}: "
                f"{t['requests']} tier-loaded requests, median time to first token {t['steps_with']:.1f} steps "
                f"({t['computed_tokens_with']:.0f} tokens computed) with the tier, {t['steps_without']:.1f} "
                f"({t['computed_tokens_without']:.0f}) without")
    return "\n".join(lines)


def compare_tier_loaded(results: list[dict]) -> None:
    """For each row with a tier, its tier-loaded requests' time to first token against the same
    requests in the row without a tier of the same HBM configuration (if one ran): row
    ["tier_loaded_ttft"] = {"requests", "steps_with", "steps_without", "computed_tokens_with",
    "computed_tokens_without"}, medians. A tier load makes its request wait for the step that loads
    it; what that wait costs or saves shows here, in the replay's units."""
    without = {(r["kv_blocks"], r["checkpoint_units"], r["checkpoint_interval"]): r
               for r in results if not r["tier_bytes"]}
    for r in results:
        base = without.get((r["kv_blocks"], r["checkpoint_units"], r["checkpoint_interval"]))
        if not r["tier_bytes"] or base is None:
            continue
        ids = [i for i in r["tier_loaded_requests"] if i in r["first_token_at"] and i in base["first_token_at"]]
        row: dict[str, float] = {"requests": len(ids)}
        for side, source in (("with", r), ("without", base)):
            for k, name in enumerate(("steps", "computed_tokens")):
                row[f"{name}_{side}"] = _quantiles([source["first_token_at"][i][k] for i in ids])["median"]
        r["tier_loaded_ttft"] = row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench cache-sim", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="Mooncake trace, JSONL")
    p.add_argument("--kv-blocks", default="2000,8000,32000", help="comma-separated KV cache sizes in 512-token blocks")
    p.add_argument("--intervals", default="2048,8192,32768", help="comma-separated checkpoint intervals in tokens")
    p.add_argument("--checkpoint-units", default=None, help="comma-separated, one per --kv-blocks (default kv/8)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tier-bytes", default="0",
                   help="comma-separated offload tier sizes, e.g. 0,64GiB,256GiB (0: HBM only); each runs every config")
    p.add_argument("--tier-chunk-tokens", type=int, default=TRACE_BLOCK_TOKENS,
                   help="the tier's KV chunk in tokens, a multiple of 512")
    p.add_argument("--tier-max-pending-saves", type=int, default=2, help="tier saves in flight; more are skipped")
    p.add_argument("--tier-eviction", choices=("lru", "clairvoyant"), default="lru",
                   help="the tier index's eviction: lru (the engine's) or clairvoyant (by the trace's future: "
                        "a bound on better policies, not one an engine can run)")
    p.add_argument("--tier-admission", choices=("all", "continuing"), default="all",
                   help="which requests the tier saves: all, or continuing (cache_control admission with the hint "
                        "on the requests a later prompt extends, as a client that knows it will continue sends)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the grid kv_blocks x intervals x tier sizes, print one row per configuration (the table
    last); returns the rows."""
    args = build_parser().parse_args(argv)
    kv_sizes = _ints(args.kv_blocks)
    units = _ints(args.checkpoint_units) if args.checkpoint_units else [n // 8 for n in kv_sizes]
    if len(units) != len(kv_sizes):
        raise SystemExit(f"--checkpoint-units={args.checkpoint_units} needs one value per --kv-blocks={args.kv_blocks}")
    intervals = _ints(args.intervals)
    bad = [n for n in intervals if n < 1 or n % TRACE_BLOCK_TOKENS]
    if bad or not intervals:
        raise SystemExit(f"--intervals={args.intervals}: each must be a positive multiple of the trace's "
                         f"{TRACE_BLOCK_TOKENS}-token blocks")
    if not kv_sizes or min(kv_sizes + units) < 1:
        raise SystemExit(f"--kv-blocks={args.kv_blocks} and --checkpoint-units must be positive")
    tier_sizes = parse_tier_sizes(args.tier_bytes)
    records = read_trace(args.trace, args.max_requests)
    print(
        f"trace={args.trace} requests={len(records)} block_size={TRACE_BLOCK_TOKENS} "
        f"max_tokens=min(output_length, {args.max_output_tokens}) concurrency={args.concurrency} "
        "one checkpoint = one unit (unit-sized image); arrivals in trace order under the concurrency limit"
    )
    if any(tier_sizes):
        kv_chunk_bytes, image_bytes = tier_object_bytes(args.tier_chunk_tokens)
        print(
            f"offload tier: ideal and lossless (every save and load done in the step that orders it), "
            f"{'LRU' if args.tier_eviction == 'lru' else 'clairvoyant (by the trace future: a bound)'} by bytes; "
            f"{MODEL_PRESET} bf16 objects: KV chunk of {args.tier_chunk_tokens} tokens = {kv_chunk_bytes} B, "
            f"state image = {image_bytes} B; max_pending_saves={args.tier_max_pending_saves}"
        )
    results = []
    for kv_blocks, num_units in zip(kv_sizes, units, strict=True):
        for interval in intervals:
            for tier_bytes in tier_sizes:
                r = run_cache_sim(
                    args.trace,
                    kv_blocks,
                    num_units,
                    interval,
                    max_output_tokens=args.max_output_tokens,
                    concurrency=args.concurrency,
                    records=records,
                    tier_bytes=tier_bytes,
                    tier_chunk_tokens=args.tier_chunk_tokens,
                    tier_max_pending_saves=args.tier_max_pending_saves,
                    tier_eviction=args.tier_eviction,
                    tier_admission=args.tier_admission,
                )
                print(f"kv_blocks={kv_blocks} interval={interval} tier={format_bytes(tier_bytes)}: "
                      f"{r['seconds']:.1f}s", flush=True)
                results.append(r)
    compare_tier_loaded(results)
    for r in results:  # per-request lists, for compare_tier_loaded only
        del r["first_token_at"], r["tier_loaded_requests"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(format_table(results))
    return results
