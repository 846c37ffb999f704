"""How far apart a trace's prefix reuses are, and whether a save's reuse can be told at save time.

For the offload tier (issue 18): an LRU tier keeps what was saved within roughly its capacity over
the bytes saved per request; a reuse further back than that is lost. This reads the Mooncake trace
alone (no scheduler) and prints:

- reuse distance: for each request's oracle hit (its longest leading run of blocks that an earlier
  request held), the requests between it and the latest earlier request holding that whole run;
  the share of hit blocks within each distance;
- reuse by save-time features: of the blocks a request adds (past its own hit), the share some later
  request's hit covers, by the request's hit fraction, the block's depth and the prompt's length:
  what an admission rule could use to skip saves no one will read.

usage: python benchmarks/tier_reuse.py [--trace PATH] [--distances 443,1770,3540] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence

from deltaserve.bench.mooncake import TRACE_BLOCK_TOKENS, TraceRecord, read_trace

DEFAULT_TRACE = "../shared/traces/mooncake_conversation_trace.jsonl"


def full_blocks(r: TraceRecord) -> list[int]:
    return r.hash_ids[: r.input_length // TRACE_BLOCK_TOKENS]


def reuse(records: Sequence[TraceRecord]) -> tuple[list[int], list[tuple[int, int]], Counter]:
    """Per request its oracle hit in blocks; per hit (distance to the latest holder, blocks); and
    per (request, block number) of a block it added first, how many later hits covered it."""
    latest: dict[tuple, int] = {}  # a leading run of blocks -> the latest request holding it
    owner: dict[tuple, tuple[int, int]] = {}  # -> (the first request holding it, its block number)
    hits, distances, reads = [], [], Counter()
    for j, r in enumerate(records):
        blocks = full_blocks(r)
        cap = (r.input_length - 1) // TRACE_BLOCK_TOKENS
        best, source, run = 0, None, ()
        for n, h in enumerate(blocks[:cap], 1):
            run = (*run, h)
            if run not in latest:
                break
            best, source = n, latest[run]
            reads[owner[run]] += 1
        hits.append(best)
        if best:
            distances.append((j - source, best))
        run = ()
        for n, h in enumerate(blocks, 1):
            run = (*run, h)
            latest[run] = j
            owner.setdefault(run, (j, n))
    return hits, distances, reads


def share_by(records, hits, reads, feature) -> dict[str, dict]:
    """Of the blocks each request added past its hit: count and share read later, by feature(i, n)."""
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i, r in enumerate(records):
        blocks = full_blocks(r)
        for n in range(hits[i] + 1, len(blocks) + 1):
            row = table[feature(i, n, len(blocks))]
            row[0] += 1
            row[1] += reads[(i, n)] > 0
    return {k: {"blocks": v[0], "read_later": round(v[1] / v[0], 3)} for k, v in sorted(table.items())}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--distances", default="100,443,1000,1770,3540,6000",
                   help="requests back; 443, 1770 and 3540 are what LRU tiers of 64, 256 and 512 GiB keep at "
                        "the 48B shape's saves per request on this trace")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    records = read_trace(args.trace, None)
    hits, distances, reads = reuse(records)
    total = sum(b for _, b in distances)
    by_distance = {int(c): round(sum(b for d, b in distances if d <= int(c)) / total, 3)
                   for c in args.distances.split(",")}
    added = sum(len(full_blocks(r)) - h for r, h in zip(records, hits, strict=True))
    read_later = sum(1 for i, r in enumerate(records) for n in range(hits[i] + 1, len(full_blocks(r)) + 1)
                     if reads[(i, n)])
    out = {
        "trace": args.trace, "requests": len(records), "requests_with_a_hit": len(distances),
        "median_distance": statistics.median(d for d, _ in distances),
        "hit_blocks_within_distance": by_distance,
        "blocks_added": added, "blocks_added_read_later": round(read_later / added, 3),
        "read_later_by_hit_fraction": share_by(
            records, hits, reads, lambda i, n, m: f"{min(int(hits[i] / max(m, 1) * 5), 4) / 5:.1f}"),
        "read_later_by_depth_blocks": share_by(records, hits, reads, lambda i, n, m: f"{min(n // 16, 6) * 16:03d}+"),
        "read_later_by_prompt_blocks": share_by(records, hits, reads, lambda i, n, m: f"{min(m // 16, 6) * 16:03d}+"),
    }
    for k, v in out.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
