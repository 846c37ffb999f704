"""One log line of throughput and cache statistics every few seconds while the engine is busy."""

from __future__ import annotations

import logging
import time
from typing import Any

from deltaserve.engine.core import IterationStats

logger = logging.getLogger("deltaserve.engine")


class StatsLogger:
    """Accumulates step statistics and logs a summary every `interval_s` seconds of activity."""

    def __init__(self, interval_s: float = 5.0, log: logging.Logger | None = None) -> None:
        self.interval_s = interval_s
        self.log = log or logger
        self._start = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queried = 0
        self._last_hits = 0
        self._last_spec = (0, 0, 0)  # drafts, draft tokens, accepted tokens at the last line

    def record(self, stats: IterationStats) -> None:
        self._prompt_tokens += stats.num_computed_tokens - min(stats.num_generation_tokens,
                                                               stats.num_computed_tokens)
        self._generation_tokens += stats.num_generation_tokens

    def due(self, now: float | None = None) -> bool:
        """Whether the interval has passed (so the caller builds a snapshot only then)."""
        now = time.monotonic() if now is None else now
        return now - self._start >= self.interval_s

    def maybe_log(self, snapshot: dict[str, Any], now: float | None = None) -> str | None:
        """Log (and return) the line if the interval has passed and something happened or is running."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        if elapsed < self.interval_s:
            return None
        sched, kv = snapshot["scheduler"], snapshot["kv_cache"]
        busy = self._prompt_tokens or self._generation_tokens or sched["num_running"] or sched["num_waiting"]
        line = None
        if busy:
            parts = [
                f"prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s",
                f"generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s",
                f"running: {sched['num_running']} reqs",
                f"waiting: {sched['num_waiting']} reqs",
                f"KV cache usage: {100 * kv['usage']:.1f}%",
            ]
            prefix = snapshot.get("prefix_cache")
            if prefix is not None:
                queried = prefix["queried_tokens"] - self._last_queried
                hits = prefix["hit_tokens"] - self._last_hits
                self._last_queried, self._last_hits = prefix["queried_tokens"], prefix["hit_tokens"]
                parts.append(f"prefix cache hit rate: {100 * hits / queried if queried else 0.0:.1f}%")
                cps = snapshot["checkpoints"]
                parts.append(f"state checkpoints: {cps['num_checkpoints']}/{cps['capacity']}")
            spec = snapshot.get("spec_decode")
            if spec is not None:
                parts.append(self._spec_part(spec))
            line = ", ".join(parts)
            self.log.info("engine: %s", line)
        self._start = now
        self._prompt_tokens = self._generation_tokens = 0
        return line

    def _spec_part(self, spec: dict[str, Any]) -> str:
        """Speculative decoding since the last line: acceptance rate and mean acceptance length."""
        totals = (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"])
        drafts, tokens, accepted = (now - last for now, last in zip(totals, self._last_spec, strict=True))
        self._last_spec = totals
        rate = 100 * accepted / tokens if tokens else 0.0
        length = 1 + accepted / drafts if drafts else 0.0
        return f"spec decode: acceptance rate {rate:.1f}%, mean acceptance length {length:.2f}"

