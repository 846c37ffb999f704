"""Mooncake traces: one JSON object a line with `timestamp` (ms from the start), `input_length`,
`output_length` and `hash_ids`, one id per 512-token block of the input (equal ids, equal blocks)."""

from __future__ import annotations

import json
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512  # tokens per Mooncake hash id


@dataclass(frozen=True)
class TraceRecord:
    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str, max_requests: int | None = None) -> list[TraceRecord]:
    """The trace's records in arrival (timestamp) order, at most `max_requests` of them (the first in the file)."""
    records = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                records.append(TraceRecord(int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                                           tuple(int(h) for h in r["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"trace {path} line {line_number}: expected timestamp, input_length, output_length and "
                    f"hash_ids ({type(e).__name__}: {e})"
                ) from None
            if max_requests is not None and len(records) >= max_requests:
                break
    records.sort(key=lambda r: r.timestamp)  # stable: ties keep file order
    return records
