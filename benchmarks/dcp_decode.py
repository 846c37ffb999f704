"""Decode step time under decode context parallelism against TP alone, and the latent bytes each rank holds.

For each setting in turn (TP=tp alone, then TP=tp x DCP=dcp) this builds the engine on the
multi-process executor, adds B requests of a random `--context`-token prompt, steps until every
request has its first token, then times `--steps` engine-core steps of pure decode after `--warmup`
untimed ones. Under DCP each rank attends over its stripe of every context and the step adds an
all-gather of the queries and one of the partial outputs and log-sum-exps (the merge runs in
float32); the latents each rank holds shrink by the group's size. Medians of the timed steps.

Usage (CPU, gloo, tiny model: what the gather and merge cost, not GPU speed):
  python benchmarks/dcp_decode.py --model random:tiny --device cpu --contexts 1024,3072 --batches 1,4
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics

from decode_timing import time_decode_steps
from host_step_time import machine

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(dcp: int, batch: int, context: int, args: argparse.Namespace) -> dict:
    """Median ms per decode step of `batch` requests of `context` tokens at TP=args.tp x DCP=dcp."""
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=batch,
        max_num_batched_tokens=args.prefill_budget, max_model_len=context + args.steps + args.warmup + 64,
        enable_prefix_caching=False, tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
        cache_memory=args.cache_memory,
    )
    engine = LLMEngine(config)
    try:
        core = engine.core
        times = time_decode_steps(engine, batch, context, args.steps, args.warmup)
        kv = core.model_kv_spec
        per_rank = batch * context * kv.bytes_per_token // dcp
        return {"tp": args.tp, "dcp": dcp, "batch": batch, "context": context, "median_ms": statistics.median(times),
                "min_ms": min(times), "steps": len(times), "latent_bytes_per_rank": per_rank,
                "kv_capacity_tokens": core.cache_plan.num_blocks * config.scheduler_block_size}
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--contexts", default="1024,3072", help="prompt tokens per request, comma-separated")
    parser.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prefill-budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--cache-memory", default="256MiB")
    parser.add_argument("--out", default=None, help="JSON path (default results/dcp_decode_<date>_<dev>.json)")
    args = parser.parse_args()

    rows = []
    print(f"{'batch':>5} {'context':>7} {'tp ms':>8} {'dcp ms':>8} {'ratio':>6} {'MiB/rank tp':>11} {'dcp':>6}",
          flush=True)
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            alone, split = measure(1, batch, context, args), measure(args.dcp, batch, context, args)
            rows.append({"alone": alone, "dcp": split, "ratio": split["median_ms"] / alone["median_ms"]})
            print(f"{batch:>5} {context:>7} {alone['median_ms']:8.2f} {split['median_ms']:8.2f} "
                  f"{rows[-1]['ratio']:6.2f} {alone['latent_bytes_per_rank'] / 2**20:11.2f} "
                  f"{split['latent_bytes_per_rank'] / 2**20:6.2f}", flush=True)
    today = datetime.date.today().isoformat()
    result = {
        "date": today, **machine(None),
        "what": "ms per decode step (engine-core step) at TP alone and TP x DCP on the multi-process executor; "
                "medians over the timed steps; latent_bytes_per_rank = the batch's MLA latents on one rank",
        "args": vars(args), "rows": rows,
    }
    path = args.out or os.path.join(HERE, "results", f"dcp_decode_{today}_{args.device}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
