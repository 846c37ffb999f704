"""Prometheus series of the engine core, named as vLLM's are where a counterpart exists.

They live in the engine-core process, the one place that sees every request whichever API front
end it came through; a front end's GET /metrics asks the core for `exposition()`. Counters the core
keeps as running totals (prefix-cache queries, checkpoints filed) are turned into increments here.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltaserve.engine.core import IterationStats

PREFIX = "deltaserve:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(float(value))
        scale *= 10


class EngineMetrics:
    """Every series the engine core exports; `record()` once per step, `exposition()` per scrape."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._model = model_name

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0 to 1).")
        self.state_slot_usage = gauge("state_slot_usage_perc", "Fraction of KDA state slots in use (0 to 1).")
        self.checkpoints = gauge("state_checkpoints", "KDA state checkpoints held by the prefix cache.")
        self.checkpoints_pinned = gauge("state_checkpoints_pinned",
                                        "KDA state checkpoints held by a request that is loading them.")
        self.checkpoint_usage = gauge("state_checkpoint_usage_perc",
                                      "Fraction of state checkpoint units holding a checkpoint (0 to 1).")
        self.preemptions = counter("num_preemptions", "Requests preempted (to be recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.computed_tokens = counter("computed_tokens", "Tokens run through the model (prefill and decode).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache, once per request.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache, at each request's first admission.")
        self.aborted = counter("request_aborted", "Requests aborted (client gone, or cancelled).")
        self._success = Counter(PREFIX + "request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._filed = Counter(PREFIX + "state_checkpoints_filed", "KDA state checkpoints filed, by kind.",
                              ["model_name", "kind"], registry=r)
        self._evicted = Counter(PREFIX + "state_checkpoints_evicted", "KDA state checkpoints evicted, by kind.",
                                ["model_name", "kind"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _E2E_BUCKETS)
        tokens = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                               tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated by finished requests.", tokens)
        self.batches_in_flight = gauge("pipeline_batches_in_flight",
                                       "Batches scheduled and not yet returned by the executor.")
        self.max_batches_in_flight = gauge("pipeline_max_batches_in_flight",
                                           "The most batches in flight at once since start.")
        self._stage_busy = Counter(PREFIX + "pipeline_stage_busy_seconds",
                                   "Seconds each pipeline stage spent running steps (multi-process executor).",
                                   ["model_name", "stage"], registry=r)
        self._stage_steps = Counter(PREFIX + "pipeline_stage_steps", "Steps each pipeline stage ran.",
                                    ["model_name", "stage"], registry=r)
        self.transfers_held = gauge("kv_transfer_held_requests",
                                    "P/D producer: finished requests whose KV and state wait for their consumer.")
        self.transfers_streaming = gauge("kv_transfer_streams",
                                         "P/D producer, chunked transfer: requests whose progress consumers can ask "
                                         "for (running, held, or ended and kept until their timeout).")
        self.transfers_waiting = gauge("kv_transfer_loading_requests",
                                       "P/D consumer: requests waiting for their KV and state to arrive.")
        self.transfers_expired = counter("kv_transfer_expired",
                                         "P/D producer: held requests freed because no consumer read them in time.")
        # TieredStore.stats() key -> its series; latency as seconds and calls counters (rate(s) / rate(calls))
        self._tier_counters = {
            key: Counter(PREFIX + "offload_tier_" + series, doc, ["model_name", "tier"], registry=r)
            for key, series, doc in (
                ("hits", "hits", "Offload tier: objects loaded from this tier (the fastest holding a valid copy)."),
                ("misses", "misses", "Offload tier: loads this tier did not hold."),
                ("stored_bytes", "stored_bytes", "Offload tier: bytes written to this tier."),
                ("loaded_bytes", "loaded_bytes", "Offload tier: bytes read from this tier."),
                ("evictions", "evictions", "Offload tier: objects this tier evicted (least recently used)."),
                ("corrupt_objects", "corrupt_objects",
                 "Offload tier: objects found corrupt, truncated or foreign (dropped, a miss)."),
                ("failures", "failures", "Offload tier: calls that failed (the tier is then skipped for a while)."),
                ("store_seconds_sum", "store_seconds", "Offload tier: seconds spent storing objects."),
                ("store_count", "store_calls", "Offload tier: objects stored (store latency: store_seconds / this)."),
                ("load_seconds_sum", "load_seconds", "Offload tier: seconds spent loading objects."),
                ("load_count", "load_calls", "Offload tier: loads (load latency: load_seconds / this)."),
            )
        }
        self._tier_degraded = Gauge(PREFIX + "offload_tier_degraded", "Offload tier: 1 while skipped after a failure.",
                                    ["model_name", "tier"], registry=r)
        self.offload_loads = counter("offload_loads", "Offload tier: requests whose joint hit was loaded.")
        self.offload_load_failures = counter("offload_load_failures",
                                             "Offload tier: loads that failed on some rank (recomputed).")
        self.offload_loaded_tokens = counter("offload_loaded_tokens",
                                             "Offload tier: tokens whose KV loads brought back from the tier.")
        self.offload_hit_tokens = counter("offload_hit_tokens",
                                          "Offload tier: prompt tokens its loads added to the HBM prefix-cache hit "
                                          "(the tier's share of prefix_cache_hits).")
        self.offload_saves = counter("offload_saves", "Offload tier: checkpoint saves every rank stored.")
        self.offload_saves_skipped = counter("offload_saves_skipped",
                                             "Offload tier: saves that found max pending saves in flight (deferred).")
        # speculative decoding, vLLM's series
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: verify windows run.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Speculative decoding: draft tokens accepted.")
        self._spec_accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                              "Speculative decoding: drafts accepted at each position of a window.",
                                              ["model_name", "position"], registry=r)
        self._last_totals: dict[str, float] = {}

    def _increment(self, key: str, counter: Any, total: float) -> None:
        """Counters the core keeps as running totals: add what is new since the last call."""
        delta = total - self._last_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def record(self, stats: IterationStats | None, snapshot: dict[str, Any]) -> None:
        """Apply one step's stats and the core's current `get_metrics()` snapshot."""
        if stats is not None:
            self.record_step(stats)
        self.record_snapshot(snapshot)

    def record_step(self, stats: IterationStats) -> None:
        """Counters and histograms of one step (cheap: runs every step)."""
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_computed_tokens:
            self.computed_tokens.inc(stats.num_computed_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for done in stats.finished:
            self._success.labels(self._model, done.finish_reason).inc()
            self.e2e.observe(done.e2e_latency)
            self.queue_time.observe(done.queue_time)
            self.request_prompt_tokens.observe(done.num_prompt_tokens)
            self.request_generation_tokens.observe(done.num_generation_tokens)

    def record_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Gauges, and counters kept by the core as running totals, from `get_metrics()` (per scrape)."""
        sched, kv, slots = snapshot["scheduler"], snapshot["kv_cache"], snapshot["state_slots"]
        self.num_requests_running.set(sched["num_running"])
        self.num_requests_waiting.set(sched["num_waiting"])
        self.kv_cache_usage.set(kv["usage"])
        self.state_slot_usage.set(1.0 - slots["num_free"] / slots["num_slots"] if slots["num_slots"] else 0.0)
        self._increment("preemptions", self.preemptions, sched["num_preemptions"])
        prefix = snapshot.get("prefix_cache")
        if prefix is not None:
            self._increment("queries", self.prefix_queries, prefix["queried_tokens"])
            self._increment("hits", self.prefix_hits, prefix["hit_tokens"])
        self._record_executor(snapshot.get("executor", {}))
        transfer = snapshot.get("kv_transfer")
        if transfer is not None:
            self.transfers_held.set(transfer["held_for_transfer"])
            self.transfers_streaming.set(transfer["streams"])
            self.transfers_waiting.set(transfer["remote_waiting"])
            self._increment("transfers_expired", self.transfers_expired, transfer["expired_transfers"])
        offload = snapshot.get("offload")
        if offload is not None:
            self._record_offload(offload)
        spec = snapshot.get("spec_decode")
        if spec is not None:
            for key, counter in (("num_drafts", self.spec_drafts), ("num_draft_tokens", self.spec_draft_tokens),
                                 ("num_accepted_tokens", self.spec_accepted_tokens)):
                self._increment(f"spec:{key}", counter, spec[key])
            for position, total in enumerate(spec["accepted_per_position"]):
                self._increment(f"spec:pos:{position}", self._spec_accepted_per_pos.labels(self._model, str(position)),
                                total)
        cps = snapshot.get("checkpoints")
        if cps is not None:
            self.checkpoints.set(cps["num_checkpoints"])
            self.checkpoints_pinned.set(cps["num_pinned"])
            self.checkpoint_usage.set(cps["num_checkpoints"] / cps["capacity"] if cps["capacity"] else 0.0)
            for kind, total in cps["filed"].items():
                self._increment(f"filed:{kind}", self._filed.labels(self._model, str(kind)), total)
            for kind, total in cps["evicted"].items():
                self._increment(f"evicted:{kind}", self._evicted.labels(self._model, str(kind)), total)

    def _record_executor(self, executor: dict[str, Any]) -> None:
        """Batches in flight, and each stage's busy seconds and steps (kept by the ranks as totals)."""
        if "batches_in_flight" in executor:
            self.batches_in_flight.set(executor["batches_in_flight"])
            self.max_batches_in_flight.set(executor["max_batches_in_flight"])
        for stage, total in enumerate(executor.get("stage_busy_seconds", ())):
            self._increment(f"busy:{stage}", self._stage_busy.labels(self._model, str(stage)), total)
        for stage, total in enumerate(executor.get("stage_steps", ())):
            self._increment(f"steps:{stage}", self._stage_steps.labels(self._model, str(stage)), total)

    def _record_offload(self, offload: dict[str, Any]) -> None:
        """The offload tier's totals, and each tier's counters summed over the ranks."""
        for key, counter in (("loads_done", self.offload_loads), ("loads_failed", self.offload_load_failures),
                             ("loaded_tokens", self.offload_loaded_tokens), ("hit_tokens", self.offload_hit_tokens),
                             ("saves_done", self.offload_saves),
                             ("saves_skipped", self.offload_saves_skipped)):
            self._increment(f"offload:{key}", counter, offload[key])
        for tier, row in offload["tiers"].items():
            for key, counter in self._tier_counters.items():
                self._increment(f"tier:{tier}:{key}", counter.labels(self._model, tier), row.get(key, 0))
            self._tier_degraded.labels(self._model, tier).set(row.get("degraded", 0))

    def record_aborts(self, count: int) -> None:
        if count:
            self.aborted.inc(count)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
