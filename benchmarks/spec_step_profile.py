"""Where a speculative step's time goes: per method, the engine steps of one timed batch on the trained
default models, their median wall time and tokens per step, and the host functions that took the most time.

Each method's engine is warmed up on the same shapes (reversed prompts), then one `LLM.generate` of --batch
held-out prompts runs twice: once with every `engine.step()` timed (median step after the prefill, drafts made,
output tokens per step and request), once under cProfile (deltaserve's functions by own time and by
cumulative time; on a GPU the device work shows up where the host waits for it: the sampler's copy to the
host). The numbers say whether drafting, verification, rollback or bookkeeping is what a step pays above a
plain decode step.

Usage (CPU or GPU):
  python benchmarks/spec_step_profile.py --batch 16 --methods off,ngram,draft_model,eagle3 --dtype bfloat16
"""

from __future__ import annotations

import cProfile
import datetime
import gc
import json
import os
import pstats
import statistics
import time

import torch
from host_step_time import machine
from spec_acceptance import chosen_methods, held_out_prompts, run, trained_model_args

from deltaserve import LLM

HERE = os.path.dirname(os.path.abspath(__file__))


def timed_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Wall seconds of every engine step of one generate call (synchronized on a GPU)."""
    engine = llm.llm_engine
    step, seconds = engine.step, []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed():
        sync()
        started = time.perf_counter()
        value = step()
        sync()
        seconds.append(time.perf_counter() - started)
        return value

    engine.step = timed
    try:
        run(llm, prompts, max_tokens)
    finally:
        del engine.step  # the class's method again
    return seconds


def top_functions(profile: cProfile.Profile, key: str, count: int) -> list[dict]:
    """deltaserve's functions with the most time by `key` ('tottime' or 'cumtime')."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    rows = [{"function": f"{os.path.relpath(path, os.path.dirname(HERE))}:{line}({name})", "calls": calls,
             "tottime_s": tottime, "cumtime_s": cumtime}
            for (path, line, name), (_, calls, tottime, cumtime, _) in stats.items() if "deltaserve/" in path]
    return sorted(rows, key=lambda r: r[key + "_s"], reverse=True)[:count]


def main() -> None:
    args = trained_model_args(__doc__.split("\n")[0], {  # --batches is unused: one batch, --batch
        "--batch": {"type": int, "default": 16}, "--top": {"type": int, "default": 25}})
    prompts = held_out_prompts(args.prompt_len)
    chosen = [prompts[i % len(prompts)] for i in range(args.batch)]
    results = []
    for method, spec in chosen_methods(args.methods, args.k).items():
        llm = LLM(dtype=args.dtype, device=args.device, speculative_config=spec, max_num_seqs=args.batch,
                  cache_memory=args.cache_memory)
        run(llm, [p[::-1] for p in chosen], 8)  # warm-up on every shape, no prefix hits later
        run(llm, [p[::-1] for p in chosen], args.max_tokens)
        before = (llm.get_metrics().get("spec_decode") or {}).get("num_drafts", 0)
        seconds = timed_steps(llm, chosen, args.max_tokens)
        drafts = (llm.get_metrics().get("spec_decode") or {}).get("num_drafts", 0) - before
        profile = cProfile.Profile()
        profile.enable()
        run(llm, [p[:-1] for p in chosen], args.max_tokens)  # one token shorter: no prefix hit on the last run
        profile.disable()
        decode = seconds[1:]  # the first step is the prompts' prefill
        row = {"method": method, "steps": len(seconds), "median_step_ms": statistics.median(decode) * 1e3,
               "first_step_ms": seconds[0] * 1e3, "total_s": sum(seconds), "drafts": drafts,
               "tokens_per_step_per_request": args.max_tokens / max(len(decode), 1),
               "by_own_time": top_functions(profile, "tottime", args.top),
               "by_cumulative_time": top_functions(profile, "cumtime", args.top)}
        results.append(row)
        print(f"== {method}: {row['steps']} steps, median {row['median_step_ms']:.2f} ms, "
              f"{row['tokens_per_step_per_request']:.2f} tokens/step/request, {drafts} drafts, "
              f"{row['total_s'] * 1e3:.0f} ms in all", flush=True)
        for r in row["by_own_time"]:
            print(f"   cum {r['cumtime_s'] * 1e3:8.1f} ms  own {r['tottime_s'] * 1e3:7.1f} ms  {r['calls']:6d}  "
                  f"{r['function']}", flush=True)
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    today = datetime.date.today().isoformat()
    path = args.out or os.path.join(HERE, "results", f"spec_step_profile_{today}.json")
    with open(path, "w") as f:
        json.dump({"date": today, **machine(None), "args": vars(args), "methods": results}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
