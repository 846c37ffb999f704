"""Time the Eagle3 drafter's share of a speculative step: `propose` (after the target's step: add the step's
entries to the head's caches, draft k tokens, bring them to the host), per step, on the trained default
target and eagle3 head, at each batch size (issue 19).

Every step of a greedy run on the accuracy gate's held-out prompts is timed (wall clock around `propose`,
after a device synchronize on CUDA so the target's queued work is not counted); reported: the median over
steps that drafted for the whole batch, and their count. One engine per batch size, after an untimed
warm-up run.

Usage (CPU or GPU; PYTHONPATH=<another checkout> times that checkout's drafter):
  python benchmarks/eagle3_draft_time.py --batches 1,16 --k 3
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import torch
from host_step_time import machine
from spec_acceptance import held_out_prompts, trained_model_args

from deltaserve import LLM, SamplingParams
from deltaserve.model_files.default_model import installed_trained_dir


def timed_propose(drafter, device: torch.device, times: list[tuple[int, float]]) -> None:
    """Wrap drafter.propose to append (requests drafted for, seconds) per call."""
    propose = drafter.propose

    def timed(*args):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        drafts = propose(*args)
        times.append((len(drafts), time.perf_counter() - started))
        return drafts

    drafter.propose = timed


def main() -> None:
    args = trained_model_args(__doc__.split("\n")[0])
    prompts = held_out_prompts(args.prompt_len)
    spec = {"method": "eagle3", "model": installed_trained_dir("eagle3"), "num_speculative_tokens": args.k}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        llm = LLM(dtype=args.dtype, device=args.device, speculative_config=spec, max_num_seqs=batch,
                  cache_memory=args.cache_memory)
        runner = llm.llm_engine.executor.worker.runner
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
        times: list[tuple[int, float]] = []
        timed_propose(runner.drafter, runner.device, times)
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        llm.generate([{"prompt_token_ids": p} for p in chosen], params, use_tqdm=False)
        full = [seconds * 1e3 for drafted, seconds in times if drafted == batch]
        row = {"batch": batch, "k": args.k, "steps": len(full),
               "median_ms": statistics.median(full) if full else None,
               "min_ms": min(full) if full else None}
        rows.append(row)
        print(f"batch {batch:>3}: propose median {row['median_ms']:.2f} ms (min {row['min_ms']:.2f}) over {len(full)} "
              "steps drafting for every request", flush=True)
        llm.llm_engine.shutdown()
    result = {"date": datetime.date.today().isoformat(), "machine": machine(None), "dtype": args.dtype, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
