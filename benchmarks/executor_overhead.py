"""Per-step overhead of the multi-process executor: one rank in its own process ("mp", TP=1) against the
worker in the engine's process ("uniproc"), for decode at each batch size.

For each executor in turn (one engine at a time: the 48B shape fits one H200 once) this builds the
engine with the same options, adds B requests of a random `--context`-token prompt each, steps until
every request has its first token (prefill done), then times `--steps` engine-core steps of pure
decode (B tokens each) after `--warmup` untimed ones. The mp engine pays, per step, pickling the
SchedulerOutput once, a ZeroMQ hop to the rank, the rank's unpickle, and the ModelRunnerOutput's way
back; the forward is the same. Written: median and mean ms per step, and the overhead in percent of
the in-process median (issue 15's goal: under 3%).

On the CPU the forward is host work, so an executor that waits for each step before taking the next
loses nothing there; `--device-ms` adds an emulated asynchronous device (`emulated_device.py`) that
takes that long per step, one value per batch size, so the CPU shows what a GPU would.

Usage (CPU smoke run, tiny model):
  python benchmarks/executor_overhead.py --model random:tiny --device cpu --batches 1,8 --context 64 --steps 16
CPU with an emulated device of 6 and 36 ms per step (the H200's 48B decode steps), async scheduling on:
  python benchmarks/executor_overhead.py --model random:tiny --device cpu --batches 1,64 --context 64 \
      --async-scheduling on --device-ms 6,36
On the H200 (48B shape, random bfloat16 weights):
  python benchmarks/executor_overhead.py --model random:kimi-linear-48b-a3b --batches 1,64 --context 4096
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import json
import multiprocessing
import os
import statistics

import torch
from decode_timing import time_decode_steps
from emulated_device import emulate_device, set_rank_threads
from host_step_time import machine

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine

HERE = os.path.dirname(os.path.abspath(__file__))
EXECUTORS = ("uniproc", "mp")
ASYNC = {"auto": None, "on": True, "off": False}


def measure(executor: str, batch: int, device_ms: float, args: argparse.Namespace) -> dict:
    """Median and mean ms per decode step of `batch` requests on a fresh engine with `executor` (and an
    emulated device of `device_ms` per step unless 0)."""
    if device_ms:
        emulate_device(device_ms)
    if args.threads is not None:  # the same in the engine's process (uniproc's worker) and in the rank
        torch.set_num_threads(args.threads)
        set_rank_threads(args.threads)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(args.prefill_budget, batch), max_model_len=args.context + args.steps
        + args.warmup + 64, enable_prefix_caching=False, distributed_executor_backend=executor,
        cache_memory=args.cache_memory, async_scheduling=ASYNC[args.async_scheduling],
    )
    engine = LLMEngine(config)
    try:
        core = engine.core
        times = time_decode_steps(engine, batch, args.context, args.steps, args.warmup)
        return {"executor": executor, "batch": batch, "median_ms": statistics.median(times),
                "mean_ms": statistics.fmean(times), "min_ms": min(times), "steps": len(times),
                "async_scheduling": core.async_scheduling, "device": core.executor.device_name,
                "emulated_device_ms": device_ms}
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_in_child(executor: str, batch: int, device_ms: float, args: argparse.Namespace) -> dict:
    """`measure` in a fresh process, so that one engine's device memory is gone before the next starts
    (the 48B shape fits one H200 once: on 2026-12-04 the in-process engine's weights were still held
    when the mp engine's rank loaded its own, and it ran out of memory)."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, executor, batch, device_ms, args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--prefill-budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--cache-memory", default=None, help="cache budget, e.g. 4GiB (default: the engine's)")
    parser.add_argument("--async-scheduling", choices=sorted(ASYNC), default="auto",
                        help="auto: the engine's default (on for CUDA, off on the CPU)")
    parser.add_argument("--device-ms", default="0",
                        help="emulated device ms per step on the CPU, one per batch size or one for all (0: none)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the worker in either executor (default: torch's, and the executor's)")
    parser.add_argument("--out", default=None, help="JSON path (default results/executor_overhead_<date>_<dev>.json)")
    args = parser.parse_args()

    rows = []
    print(f"{'batch':>5} {'uniproc ms':>10} {'mp ms':>8} {'overhead':>8}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    device_ms = [float(ms) for ms in args.device_ms.split(",")]
    if len(device_ms) not in (1, len(batches)):
        parser.error(f"--device-ms={args.device_ms!r}: give one value, or one per batch size ({len(batches)})")
    per_batch = device_ms * len(batches) if len(device_ms) == 1 else device_ms
    for batch, ms in zip(batches, per_batch, strict=True):
        pair = {name: measure_in_child(name, batch, ms, args) for name in EXECUTORS}
        overhead = 100.0 * (pair["mp"]["median_ms"] / pair["uniproc"]["median_ms"] - 1.0)
        rows.append({"batch": batch, "overhead_pct": overhead, **{name: pair[name] for name in EXECUTORS}})
        print(f"{batch:>5} {pair['uniproc']['median_ms']:10.3f} {pair['mp']['median_ms']:8.3f} {overhead:7.1f}%",
              flush=True)

    today = datetime.date.today().isoformat()
    device = rows[0]["uniproc"]["device"].split(":")[0] if rows else "cpu"
    info = machine(None)
    info["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = {
        "date": today,
        **info,
        "what": "ms per decode step (engine-core step: schedule, execute, apply) with the worker in the engine's "
                "process (uniproc) and in a rank process of the multi-process executor at TP=1 (mp); medians "
                "over the timed steps; overhead_pct = mp / uniproc - 1",
        "goal_overhead_pct": 3.0,
        "args": vars(args),
        "rows": rows,
    }
    path = args.out or os.path.join(HERE, "results", f"executor_overhead_{today}_{device}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
