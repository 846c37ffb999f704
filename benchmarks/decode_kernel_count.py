"""Kernels per decode step and the step's time, with the fusions made after loading (each attention
layer's input projections as one GEMM, the shared expert inside the routed experts' grouped GEMMs) and
without them (issue 20: decode at small batches is bound by the number of kernels).

For each variant one engine is built (random bf16 weights of --preset, CUDA graphs on). At each batch
size: the median engine-core step with graphs (decode_timing), then a few steps run eagerly under
torch.profiler (the graphs set aside), counting the CUDA kernels a step launches, their summed time,
and the kernels that launch most. "separate" builds its engine with the fusions skipped.

Usage (on the device, after `. benchmarks/device_setup.sh`):
  python benchmarks/decode_kernel_count.py --preset small --batches 1,64 --context 2048
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics

import torch
from decode_timing import time_decode_steps
from host_step_time import machine

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.model.kimi_linear import KimiLinearForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def profile_eager_steps(engine: LLMEngine, steps: int) -> dict:
    """Kernels of `steps` eager decode steps (the runner's decode graphs set aside meanwhile)."""
    runner = engine.core.executor.worker.runner
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        engine.core.step()  # warm the eager path
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.core.step()
            torch.cuda.synchronize()
    finally:
        runner.decode_graphs = graphs
    counts: collections.Counter[str] = collections.Counter()
    total_us = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name[:80]] += 1
            total_us += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return {"kernels_per_step": sum(counts.values()) / steps, "kernel_ms_per_step": total_us / 1e3 / steps,
            "top": [(name, n / steps) for name, n in counts.most_common(12)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--variants", default="fused,separate")
    parser.add_argument("--cache-memory", default="16GiB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    fuse = KimiLinearForCausalLM.fuse_after_loading
    print(f"{'variant':>9} {'batch':>5} {'graph ms':>9} {'kernels':>8} {'kernel ms':>9}", flush=True)
    for variant in args.variants.split(","):
        KimiLinearForCausalLM.fuse_after_loading = fuse if variant == "fused" else (lambda self: None)
        engine = LLMEngine(EngineConfig(
            model=f"random:{args.preset}", dtype="bfloat16", max_num_seqs=max(batches),
            max_model_len=args.context + 4 * (args.steps + args.warmup + 64), enable_prefix_caching=False,
            cache_memory=args.cache_memory))
        try:
            for batch in batches:
                times = time_decode_steps(engine, batch, args.context, args.steps, args.warmup)
                profile = profile_eager_steps(engine, args.profile_steps)
                engine.abort_request([f"r{i}" for i in range(batch)])
                while engine.core.has_unfinished_requests():
                    engine.core.step()
                row = {"variant": variant, "batch": batch, "graph_median_ms": statistics.median(times),
                       "graph_min_ms": min(times), **profile}
                rows.append(row)
                print(f"{variant:>9} {batch:>5} {row['graph_median_ms']:9.3f} {row['kernels_per_step']:8.0f} "
                      f"{row['kernel_ms_per_step']:9.3f}", flush=True)
                for name, n in profile["top"][:6]:
                    print(f"{'':>16}{n:6.0f}  {name}", flush=True)
        finally:
            engine.shutdown()
    KimiLinearForCausalLM.fuse_after_loading = fuse
    today = datetime.date.today().isoformat()
    info = machine(None)
    info["device"] = torch.cuda.get_device_name()
    path = args.out or os.path.join(HERE, "results", f"decode_kernel_count_{today}.json")
    with open(path, "w") as f:
        json.dump({"date": today, **info, "args": vars(args), "rows": rows,
                   "what": "median engine-core decode step with CUDA graphs; kernels and kernel time per eager "
                           "decode step under torch.profiler; input projections and shared expert fused or "
                           "separate"}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
