"""What a run leaves behind: the results document (JSON), its summary table, and the progress bar."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from deltaserve.bench.serve.records import RequestRecord

# (header, key path in a level, format); a None value prints as "-"
_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("C", ("concurrency",), "d"),
    ("done", ("completed",), "d"),
    ("fail", ("failed",), "d"),
    ("req/s", ("request_throughput",), ".2f"),
    ("out tok/s", ("output_tokens_per_s",), ".1f"),
    ("out/GPU", ("output_tokens_per_s_per_gpu",), ".1f"),
    ("total/GPU", ("total_tokens_per_s_per_gpu",), ".1f"),
    ("TTFT med", ("ttft_ms", "median"), ".1f"),
    ("TTFT p99", ("ttft_ms", "p99"), ".1f"),
    ("TPOT med", ("tpot_ms", "median"), ".2f"),
    ("ITL med", ("itl_ms", "median"), ".2f"),
    ("ITL p99", ("itl_ms", "p99"), ".2f"),
    ("E2E med", ("e2e_latency_ms", "median"), ".1f"),
    ("hit usage", ("prefix_cache", "usage_hit_rate"), ".1%"),
    ("hit metrics", ("prefix_cache", "metrics_hit_rate"), ".1%"),
    ("hit tier", ("prefix_cache", "tier_hit_rate"), ".1%"),
    ("oracle", ("prefix_cache", "oracle_hit_rate"), ".1%"),
)


def lookup(level: dict, path: tuple[str, ...]) -> Any:
    """The value at a key path of a level (None where any key is missing)."""
    value: Any = level
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def format_table(levels: Sequence[dict]) -> str:
    """One aligned row per level; times in ms, rates in tokens/s, hit rates in % of prompt tokens."""
    rows = [[header for header, _, _ in _COLUMNS]]
    for level in levels:
        row = []
        for _, path, fmt in _COLUMNS:
            value = lookup(level, path)
            row.append("-" if value is None else format(value, fmt))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def format_errors(levels: Sequence[dict]) -> str:
    """The errors of each level that had any, most frequent first; empty when there were none."""
    lines = []
    for level in levels:
        for error in level.get("errors") or ():
            lines.append(f"C={level['concurrency']}: {error['count']} x {error['message']}")
    return "\n".join(lines)


def record_entry(record: RequestRecord) -> dict:
    """One request for `--save-requests` (timings in ms, no token ids)."""
    n, _ = record.output_tokens

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    return {
        "index": record.index, "session_id": record.session_id, "turn": record.turn,
        "prompt_len": record.prompt_len, "max_tokens": record.max_tokens, "output_tokens": n,
        "cached_tokens": None if record.usage is None else record.usage.cached_tokens,
        "num_chunks": len(record.chunk_times), "ttft_ms": ms(record.ttft), "tpot_ms": ms(record.tpot),
        "e2e_latency_ms": ms(record.e2e_latency), "error": record.error, "cancelled": record.cancelled,
    }


def environment() -> dict:
    """Date, host and versions, for the results document."""
    import httpx
    import numpy

    from deltaserve import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "deltaserve": __version__, "httpx": httpx.__version__, "numpy": numpy.__version__,
    }


def write_json(document: dict, path: str) -> None:
    """Write the results document, making its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


class ProgressBar:
    """A tqdm bar per level on stderr: requests done, with the failures so far."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._failed = 0

    def level_started(self, level_index: int, concurrency: int, planned: int | None) -> None:
        from tqdm import tqdm

        self._failed = 0
        self._bar = tqdm(total=planned, desc=f"concurrency {concurrency}", unit="req", file=sys.stderr,
                         disable=not self.enabled, dynamic_ncols=True)

    def request_done(self, record: RequestRecord) -> None:
        if self._bar is None:
            return
        if record.error is not None:
            self._failed += 1
            self._bar.set_postfix(failed=self._failed, refresh=False)
        self._bar.update(1)

    def level_finished(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
