"""Replay the Mooncake conversation trace through the prefix cache (no model) and save the numbers.

Usage: python benchmarks/cache_sim.py [--max-requests N] [any other deltaserve.bench.cache_sim option]
Writes benchmarks/results/cache_sim_<date>.json with the date, host, versions, configs and results.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

from deltaserve.bench.cache_sim import main

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
DEFAULT_ARGS = ["--kv-blocks", "2000,8000,32000", "--intervals", "2048,8192,32768", "--max-requests", "1000"]


def run(argv: list[str]) -> str:
    args = ["--trace", TRACE, *DEFAULT_ARGS, *argv]  # later flags win
    started = time.perf_counter()
    results = main(args)
    today = datetime.date.today().isoformat()
    path = os.path.join(HERE, "results", f"cache_sim_{today}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "trace": os.path.basename(TRACE),
                "args": args[2:],
                "total_seconds": round(time.perf_counter() - started, 1),
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {os.path.relpath(path)}")
    return path


if __name__ == "__main__":
    run(sys.argv[1:])
