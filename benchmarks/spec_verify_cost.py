"""The cost side of speculative decoding: the engine-core step time of a verify step with k drafts per
request (k = 1, 3, 5) against a plain decode step, at each batch size (issue 19).

Each engine's drafter is replaced by one that drafts exactly k random tokens per request, k set per run
(0: no drafts, a plain decode step, with CUDA graphs where the engine captures them). One engine is built per
k (its verify graphs hold windows of k + 1 tokens); where it captured verify graphs, each k is timed
with them and again eagerly (the graphs dropped), in the same engine.
Random drafts are almost always rejected, so the steps timed are the verify forward, the rejection
sampler and the scheduler's work, without the state rollback copies an accepted draft adds (one KDA
state image per request, copied on the device before the next step).

Usage (CPU smoke run):
  python benchmarks/spec_verify_cost.py --model random:tiny --device cpu --batches 1,4 --context 64 --steps 8
On the H200 (48B shape, random bfloat16 weights):
  python benchmarks/spec_verify_cost.py --model random:kimi-linear-48b-a3b --batches 1,16,64 --context 4096
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics

import torch
from decode_timing import time_decode_steps
from host_step_time import machine

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine

HERE = os.path.dirname(os.path.abspath(__file__))


class RandomDrafts:
    """Drafts exactly `k` random token ids (as many as the scheduler allows) for every request."""

    def __init__(self, vocab_size: int) -> None:
        self.k = 0
        self.vocab_size = vocab_size
        self.rng = random.Random(0)

    def __call__(self, request, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab_size) for _ in range(min(self.k, n))]


def ks_with_drafts(ks: list[int]) -> list[int]:
    return [k for k in ks if k > 0] or [1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--ks", default="0,1,3,5", help="drafts per request and step (0: plain decode)")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="timed steps")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--cache-memory", default=None, help="cache budget, e.g. 16GiB (default: the engine's)")
    parser.add_argument("--out", default=None, help="JSON path (default results/spec_verify_cost_<date>_<dev>.json)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]

    rows, device, decode_ms = [], "cpu", {}  # decode_ms: batch -> plain decode step (the first engine's)
    print(f"{'batch':>5} {'k':>3} {'verify':>7} {'median ms':>10} {'vs decode':>9} {'tokens/step':>11}", flush=True)
    for k in ks_with_drafts(ks):  # one engine per k: its verify graphs hold windows of k + 1
        config = EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(batches),
            max_num_batched_tokens=max(8192, max(batches) * (k + 1)),
            max_model_len=args.context + (args.steps + args.warmup + 40) * (k + 1),
            enable_prefix_caching=False, cache_memory=args.cache_memory,
            speculative_config={"method": "ngram", "num_speculative_tokens": k},
        )
        engine = LLMEngine(config)
        drafts = RandomDrafts(engine.model_config.vocab_size)
        engine.core.scheduler.spec.proposer = drafts
        runner = engine.core.executor.worker.runner  # one process: the eager rerun drops its verify graphs
        modes = ["graph", "eager"] if runner.verify_graphs is not None else ["eager"]
        try:
            for batch in batches:
                runs = [(0, "-")] if k == min(ks_with_drafts(ks)) else []
                runs += [(k, mode) for mode in modes]
                for drafted, mode in runs:
                    drafts.k = drafted
                    graphs = runner.verify_graphs
                    if mode == "eager":
                        runner.verify_graphs = None
                    times = time_decode_steps(engine, batch, args.context, args.steps, args.warmup)
                    runner.verify_graphs = graphs
                    engine.abort_request([f"r{i}" for i in range(batch)])
                    while engine.core.has_unfinished_requests():
                        engine.core.step()
                    median = statistics.median(times)
                    if drafted == 0:
                        decode_ms[batch] = median
                    ratio = median / decode_ms[batch]
                    rows.append({"batch": batch, "k": drafted, "verify": mode, "median_ms": median,
                                 "mean_ms": statistics.fmean(times), "min_ms": min(times), "steps": len(times),
                                 "vs_decode": ratio})
                    print(f"{batch:>5} {drafted:>3} {mode:>7} {median:10.3f} {ratio:9.2f} {batch * (drafted + 1):>11}",
                          flush=True)
        finally:
            device = engine.core.executor.device_name
            engine.shutdown()
            del engine, runner
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next engine sizes its caches from what is free

    today = datetime.date.today().isoformat()
    info = machine(None)
    info["device"] = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    result = {
        "date": today, **info,
        "what": "ms per engine-core step (schedule, execute, apply) of pure decode (k=0) and of verify steps with k "
                "random drafts per request (nearly all rejected: no rollback copies), verify steps replayed from "
                "CUDA graphs (graph) or run eagerly; medians over the timed steps",
        "args": vars(args), "rows": rows,
    }
    path = args.out or os.path.join(HERE, "results", f"spec_verify_cost_{today}_{info['device'].split()[0]}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
