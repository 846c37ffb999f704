"""One-run GPU benchmark of deltaserve on the Kimi Linear shape, with transformers side by side.

Usage:
    python benchmarks/h200_bench.py --out benchmarks/results/h200_<date>.json
        [--preset kimi-linear-48b-a3b|small] [--quick] [--skip-transformers]
        [--only ceilings,prefill,decode,offline,transformers] [--weights device|cpu] [--enforce-eager]

Sections (each in try/except; the JSON is rewritten after each, so a killed run keeps what it had):
ceilings (copy GB/s, bf16 matmul TFLOP/s: the MBU / MFU denominators); prefill (1 x 32k, 8 x 4k: tok/s,
MFU); decode (256 x 4k prefilled, then pure llm.llm_engine.step() at batch 256, 64, 16, 1, aborting
down: ms/step, tok/s, MBU, schedule() and execute_model() time); offline (256 x (2k + 256) through
LLM.generate); transformers (decode per token at batch 1 = (generate 64 - generate 1) / 63 on a
512-token prompt, and an 8k prefill, on deltaserve and then, deltaserve freed, on transformers'
KimiLinearForCausalLM). Formulas: the docstrings of prefill_flops and decode_step_bytes (model_costs.py).

Same weights, nothing on disk: each hub-layout tensor comes from its own generator seeded with
random_weights.tensor_seed(seed, name), drawn on the GPU (--weights device, make-model's init rules
via random_weights.random_tensor) or on the CPU (--weights cpu: iter_random_weights, make-model's
exact bits, slower). deltaserve loads the stream (model.loader.load_model, then
LLM(model="random:<preset>", _model=model)); once it is freed the stream is drawn again into
transformers' parameters (hf_target); fingerprints and greedy tokens of both go in the JSON.
--quick: the small preset and sizes. fla autotunes for a minute or two on first use of a head count,
during the engine's decode-graph capture and the warmup request, before anything is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.model_files.presets import count_parameters, preset_config

# sibling modules: on the path when this file runs as a script; the tests load this file by path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_weights import fill_hf_model, fingerprinted, seeded_weights  # noqa: E402
from model_costs import (  # noqa: E402
    decode_step_bytes,
    expected_distinct_experts,
    kda_state_bytes_per_request,
    linear_flops_per_token,
    lm_head_flops,
    prefill_flops,
    weight_bytes,
)

SECTIONS = ("ceilings", "prefill", "swiglu_ab", "decode", "offline", "transformers")
FULL = dict(
    preset="kimi-linear-48b-a3b", copy_gib=4, matmul_n=8192, prefill_long=32768, prefill_batch=(8, 4096),
    decode_ctx=4096, decode_batches=(256, 64, 16, 1), decode_steps=20, decode_warmup=3,
    decode_max_tokens=256,  # >= modes * batches * (warmup + probe + steps + profile): none ends while timed
    offline=(256, 2048, 256), hf_prompt=512, hf_new=64, hf_prefill=8192, reps=2,
    max_num_batched_tokens=32768, max_num_seqs=256, time_budget=540,
    reserve=dict(decode=60, offline=40, compare_deltaserve=15, transformers=100),  # seconds a section needs
)
QUICK = dict(
    FULL, preset="small", copy_gib=1, matmul_n=4096, prefill_long=8192, prefill_batch=(8, 1024),
    decode_ctx=1024, decode_steps=10, decode_warmup=2, offline=(64, 512, 64), hf_prompt=128, hf_new=16,
    hf_prefill=2048, reps=1, max_num_batched_tokens=8192, time_budget=480,  # a validation run skips nothing
    reserve=dict(decode=15, offline=10, compare_deltaserve=5, transformers=40),
)
SPEC_PEAKS = {"H200": {"bf16_dense_tflops": 989.4, "hbm_tbps": 4.8}}  # SXM datasheet, for reference only


# Model FLOPs and bytes: model_costs.py; the random weights: bench_weights.py ----------------------


START = time.perf_counter()


def log(msg: str) -> None:
    stamp = f"[{datetime.datetime.now():%H:%M:%S} +{time.perf_counter() - START:6.1f}s]"
    print(f"{stamp} {msg}", file=sys.stderr, flush=True)


def cuda_time(fn, reps: int, warmup: int) -> list[float]:
    """Seconds per call of fn, by CUDA events, after warmup calls."""
    out = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            out.append(start.elapsed_time(end) / 1e3)
    return out


def wall(fn) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, value


def greedy(max_tokens: int) -> Any:
    from deltaserve import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


@dataclass
class Run:
    args: argparse.Namespace
    sizes: dict[str, Any]
    config: KimiLinearConfig
    out_path: str
    preset: str
    sections: list[str]
    results: dict[str, Any] = field(default_factory=dict)
    llm: Any = None
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))

    def rate(self, key: str) -> float | None:  # a measured ceiling, None when that section failed
        return self.results.get("ceilings", {}).get(key)

    def save(self) -> None:  # atomically, so a kill mid-write leaves the previous version
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        with open(self.out_path + ".tmp", "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(self.out_path + ".tmp", self.out_path)


def run_section(run: Run, name: str, fn) -> bool:
    """fn(run) -> dict into results[name]; an exception is recorded there instead. Skipped when the
    time budget would be overrun by the seconds the section is expected to need at least."""
    budget = run.args.time_budget or run.sizes["time_budget"]
    if time.perf_counter() - START + run.sizes["reserve"].get(name, 0) > budget:
        run.results[name] = {"skipped": f"time budget of {budget} s (--time-budget) would be exceeded"}
        log(f"{name}: skipped (time budget)")
        return False
    log(f"{name}: start")
    t0, ok = time.perf_counter(), True
    try:
        run.results[name] = fn(run)
    except Exception as e:  # one failing section must not lose the others
        ok = False
        run.results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        del e  # drop the frames (and tensors) the traceback holds
        gc.collect()
        torch.cuda.empty_cache()
    run.results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    log(f"{name}: done in {run.results[name]['seconds']} s")
    run.save()
    return ok


# Sections ---------------------------------------------------------------------------------------
def section_ceilings(run: Run) -> dict[str, Any]:
    """Copy: one nbytes tensor into another (2 * nbytes moved). Matmul: bf16 [n, n] @ [n, n] (2 n^3)."""
    nbytes, n = int(run.sizes["copy_gib"] * 2**30), run.sizes["matmul_n"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=run.device).random_()
    dst = torch.empty_like(src)
    copy = cuda_time(lambda src=src, dst=dst: dst.copy_(src), reps=10, warmup=3)
    del src, dst
    a, b, c = (torch.randn(n, n, device=run.device, dtype=torch.bfloat16) for _ in range(3))
    mm = cuda_time(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), reps=20, warmup=5)
    del a, b, c
    torch.cuda.empty_cache()
    out = {"copy_bytes": nbytes, "copy_s_median": statistics.median(copy), "matmul_shape": [n, n, n],
           "copy_GBps": 2 * nbytes / statistics.median(copy) / 1e9, "copy_GBps_max": 2 * nbytes / min(copy) / 1e9,
           "matmul_s_median": statistics.median(mm), "matmul_TFLOPs_max": 2 * n**3 / min(mm) / 1e12,
           "matmul_TFLOPs": 2 * n**3 / statistics.median(mm) / 1e12}
    log(f"ceilings: copy {out['copy_GBps']:.0f} GB/s, bf16 matmul {out['matmul_TFLOPs']:.0f} TFLOP/s")
    return out


def build_deltaserve(run: Run) -> dict[str, Any]:
    from deltaserve import LLM
    from deltaserve.config.parallel import ParallelConfig
    from deltaserve.model.loader import load_model

    cfg, s, args = run.config, run.sizes, run.args
    prints = run.results.setdefault("weights", {}).setdefault("deltaserve_fingerprints", {})
    weights = fingerprinted(seeded_weights(cfg, args.seed, run.dtype, run.device, args.weights), cfg, prints)
    build_s, model = wall(lambda: load_model(cfg, ParallelConfig(), run.dtype, run.device, weights))
    log(f"engine: model built in {build_s:.1f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    lengths = {"prefill": s["prefill_long"], "swiglu_ab": s["prefill_long"],
               "decode": s["decode_ctx"] + s["decode_max_tokens"],
               "offline": sum(s["offline"][1:]), "transformers": max(s["hf_prefill"], s["hf_prompt"] + s["hf_new"])}
    max_len = max(n for k, n in lengths.items() if k in run.sections) + 64  # sizes the decode graphs' tables
    options = dict(dtype=str(run.dtype).removeprefix("torch."), device=str(run.device), seed=args.seed,
                   max_model_len=max_len, max_num_seqs=s["max_num_seqs"], enable_prefix_caching=False,
                   max_num_batched_tokens=args.max_num_batched_tokens or s["max_num_batched_tokens"],
                   enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization)
    t0 = time.perf_counter()
    run.llm = LLM(model=f"random:{run.preset}", _model=model, **options)  # preset config, byte tokenizer
    init_s, plan = time.perf_counter() - t0, run.llm.llm_engine.cache_plan
    del model  # the engine holds the only reference, so freeing the LLM frees the weights
    log(f"engine: LLM ready in {init_s:.1f} s (decode graphs captured); warmup (fla autotunes on first use)")
    warm = random_prompts(4, 300, cfg.vocab_size, seed=1)
    warm_s, _ = wall(lambda: run.llm.generate(warm, greedy(8), use_tqdm=False))
    return {"model_build_s": build_s, "llm_init_s": init_s, "warmup_s": warm_s, "options": options,
            "cache_plan": dataclasses.asdict(plan), "memory_allocated_GiB": torch.cuda.memory_allocated() / 2**30}


def section_prefill(run: Run) -> dict[str, Any]:
    s, cfg, params = run.sizes, run.config, greedy(1)
    out: dict[str, Any] = {}
    for n, length in ((1, s["prefill_long"]), s["prefill_batch"]):
        key = f"{n}x{length}"
        prompts = random_prompts(n, length, cfg.vocab_size, seed=10 + n)
        times = []
        for i in range(1 + s["reps"]):  # the first is a warmup
            times.append(wall(lambda p=prompts: run.llm.generate(p, params, use_tqdm=False))[0])
            log(f"prefill {key}: {'warmup' if i == 0 else 'run'} {times[-1]:.3f} s")
        t = statistics.median(times[1:])
        flops, rate = prefill_flops(cfg, [length] * n), run.rate("matmul_TFLOPs")
        out[key] = {"seconds": t, "all_seconds": times, "tokens_per_s": n * length / t, "flops": flops,
                    "achieved_TFLOPs": flops["total"] / t / 1e12,
                    "mfu": flops["total"] / t / (rate * 1e12) if rate else None}
        if s.get("profile_prefill"):
            try:  # where the prefill's time goes, by kernel (a new prompt: no prefix hit)
                fresh = random_prompts(n, length, cfg.vocab_size, seed=20 + n)
                out[key]["profile"] = profile_kernels(
                    lambda p=fresh: run.llm.generate(p, params, use_tqdm=False), 1, top=30, sources=True)
                prof = out[key]["profile"]
                log(f"prefill {key}: {prof['kernels_per_step']:.0f} kernels, {prof['kernel_us_per_step'] / 1e6:.3f} s "
                    f"of kernel time in {prof['wall_us_per_step'] / 1e6:.3f} s")
            except Exception as e:  # a profile is a bonus: never lose the timing over it
                out[key]["profile"] = {"error": repr(e)}
    return out


def section_swiglu_ab(run: Run) -> dict[str, Any]:
    """The prefill section twice in this process, on this GPU: SwiGLU as the engine runs it (one Triton
    kernel on CUDA), then as the reference's two eager ops (`ops/activation/naive.py`, what the MLPs ran
    before the kernel), then the kernel again, so drift between the runs shows."""
    import deltaserve.model.layers.moe as moe_layer
    import deltaserve.ops.moe.grouped as grouped
    from deltaserve.ops.activation import naive

    engine = (moe_layer.silu_and_mul, grouped.silu_and_mul)
    out: dict[str, Any] = {"kernel": section_prefill(run)}
    moe_layer.silu_and_mul = grouped.silu_and_mul = naive.silu_and_mul
    try:
        out["reference"] = section_prefill(run)
    finally:
        moe_layer.silu_and_mul, grouped.silu_and_mul = engine
    out["kernel_again"] = section_prefill(run)
    return out


@contextlib.contextmanager
def routing_probe(engine: Any, num_experts: int) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """For the steps inside: (tokens, distinct experts hit) of every MoE layer call, by wrapping
    deltaserve.model.layers.moe.fused_moe (nothing is recorded if that name is gone). The runner's
    decode CUDA graphs are set aside meanwhile (a replay runs no Python), so those steps run eagerly."""
    import deltaserve.model.layers.moe as moe_layer

    original, calls = getattr(moe_layer, "fused_moe", None), []
    runner = getattr(getattr(engine.core.executor, "worker", None), "runner", None)
    graphs = getattr(runner, "decode_graphs", None)

    def wrapped(x, w13, w2, topk_weights, topk_ids, *rest, **kw):
        ids = topk_ids.reshape(-1).long()
        # w13 stacks the routed experts and, once fused, the shared one as expert num_experts: every id
        # indexes it, and only the routed ones are counted
        hit = torch.zeros(w13.shape[0], dtype=torch.bool, device=ids.device).index_fill_(0, ids, True)
        calls.append((topk_ids.shape[0], hit[:num_experts].sum()))  # summed on the device: no sync inside the step
        return original(x, w13, w2, topk_weights, topk_ids, *rest, **kw)

    if original is not None:
        moe_layer.fused_moe = wrapped
    if graphs is not None:
        runner.decode_graphs = None
    try:
        yield calls
    finally:
        if original is not None:
            moe_layer.fused_moe = original
        if graphs is not None:
            runner.decode_graphs = graphs


def timed_steps(engine: Any, n: int) -> dict[str, float | int | None]:
    """n engine steps, synchronized around them; schedule() and execute_model() timed inside.

    step_s is the mean over all n steps (wall time / n, as reported before); step_s_median and step_s_min
    are over the steps that called execute_model, the steps that ran the model (with async scheduling a
    step can find nothing to launch and return in microseconds, which a mean would count as a step).
    """
    core, sched_s, exec_s, model_steps, idle_steps = engine.core, [], [], [], []
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(fn, sink):
        def inner(*a, **kw):
            t = time.perf_counter()
            value = fn(*a, **kw)
            sink.append(time.perf_counter() - t)
            return value
        return inner

    core.scheduler.schedule = timed(core.scheduler.schedule, sched_s)  # instance attributes shadow the methods
    core.executor.execute_model = timed(core.executor.execute_model, exec_s)
    try:
        synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            launched = len(exec_s)
            t = time.perf_counter()
            engine.step()
            (model_steps if len(exec_s) > launched else idle_steps).append(time.perf_counter() - t)
        synchronize()
        total = time.perf_counter() - t0
    finally:
        del core.scheduler.schedule, core.executor.execute_model  # back to the class methods
    schedule = statistics.mean(sched_s) if sched_s else 0.0
    execute = statistics.mean(exec_s) if exec_s else 0.0
    return {"step_s": total / n,
            "step_s_median": statistics.median(model_steps) if model_steps else None,
            "step_s_min": min(model_steps) if model_steps else None,
            "steps_with_model": len(model_steps), "steps_without_model": len(idle_steps),
            "schedule_s": schedule, "execute_model_s": execute, "rest_of_step_s": total / n - schedule - execute}


def median_step(timing: dict[str, Any]) -> float:
    """The median of the steps that ran the model (the mean step where none did, or an older JSON lacks it)."""
    return timing.get("step_s_median") or timing["step_s"]


PROFILED_BATCHES = (1, 64)


def profile_kernels(fn: Callable[[], Any], n: int, top: int = 15, sources: bool = False) -> dict[str, Any]:
    """Kernels of n calls of fn under torch.profiler: count and GPU time per call, the top kernels by
    GPU time, and the wall time per call beside the kernel time (the gap: host time and idle GPU).
    sources: also the torch ops that launched the most GPU time, by input shapes and Python stack."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if sources else [])
    with profile(activities=activities, record_shapes=sources, with_stack=sources) as prof:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    rows = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    out = {
        "steps": n,
        "kernels_per_step": sum(e.count for e in kernels) / n,
        "kernel_us_per_step": total_us / n,
        "wall_us_per_step": wall_s * 1e6 / n,
        "top": [{"name": e.key[:120], "calls_per_step": e.count / n, "us_per_step": e.self_device_time_total / n,
                 "share": e.self_device_time_total / total_us if total_us else None} for e in rows],
    }
    if sources:
        ops = [e for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=6)
               if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]
        ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
        out["sources"] = [{"op": e.key, "calls_per_step": e.count / n, "us_per_step": e.self_device_time_total / n,
                           "shapes": str(e.input_shapes)[:200],
                           "stack": [f for f in e.stack if "deltaserve" in f or "fla" in f][:4]}
                          for e in ops[:top]]
    return out


def profile_steps(engine: Any, n: int, top: int = 15) -> dict[str, Any]:
    """Kernels of n engine steps under torch.profiler (see profile_kernels)."""
    return profile_kernels(engine.step, n, top)


def set_async_scheduling(engine: Any, on: bool) -> None:
    """Switch the engine core between one and two steps in flight, after applying what is in flight."""
    core = engine.core
    core.batch_queue_size = 1  # step() schedules nothing while the queue is full: it only drains
    while core._batch_queue:
        engine.step()
    core.async_scheduling = on
    core.batch_queue_size = 2 if on else 1


def section_decode(run: Run) -> dict[str, Any]:
    s, cfg, engine = run.sizes, run.config, run.llm.llm_engine
    sched, params = engine.core.scheduler, greedy(s["decode_max_tokens"])
    batches = sorted(s["decode_batches"], reverse=True)
    ids = [f"decode-{i}" for i in range(batches[0])]
    copy_bw = run.rate("copy_GBps")
    modes = [m == "on" for m in run.args.async_scheduling.split(",")]
    out: dict[str, Any] = {"context_tokens": s["decode_ctx"]}
    try:
        for rid, prompt in zip(ids, random_prompts(len(ids), s["decode_ctx"], cfg.vocab_size, seed=20), strict=True):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        t0 = time.perf_counter()
        while not (sched.num_waiting == 0 and all(r.num_output_tokens >= 1 for r in sched.running)):
            engine.step()
        out.update(prefill_all_s=time.perf_counter() - t0, running_after_prefill=sched.num_running,
                   preemptions=sched.num_preemptions_total)
        log(f"decode: {len(ids)} x {s['decode_ctx']} prefilled in {out['prefill_all_s']:.1f} s")
        alive = [r for r in ids if sched.get_request(r) is not None and not sched.get_request(r).is_finished]
        for b, on in ((b, on) for b in batches for on in modes):
            engine.abort_request(alive[b:])
            alive = alive[:b]
            set_async_scheduling(engine, on)
            for _ in range(s["decode_warmup"]):
                engine.step()
            with routing_probe(engine, cfg.num_experts) as calls:
                engine.step()  # one eager decode step: the distinct experts each MoE layer routes to
            hits = [float(d) for t, d in calls if t == b]  # a padded batch would count padding rows
            measured = statistics.mean(hits) if hits else None
            ctx0 = sum(sched.get_request(r).num_computed_tokens for r in alive)
            timing = timed_steps(engine, s["decode_steps"])
            total_context = ctx0 + b * (s["decode_steps"] + 1) / 2
            uniform = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, b)
            distinct, source = (measured, "measured_decode_step") if measured is not None else (uniform, "uniform")
            nbytes = decode_step_bytes(cfg, b, total_context, distinct)
            step_s = median_step(timing)
            # mbu: from the mean step (every step, as reported before); mbu_median: from the median of the
            # steps that ran the model, the figure the goals use
            uniform_bytes = decode_step_bytes(cfg, b, total_context, uniform)["total"]
            gbps = {"mbu": nbytes["total"] / timing["step_s"] / 1e9, "mbu_median": nbytes["total"] / step_s / 1e9,
                    "mbu_uniform_experts": uniform_bytes / step_s / 1e9}
            row = dict(timing, batch=b, async_scheduling=on, tokens_per_s=b / step_s, mean_context=total_context / b,
                       distinct_experts=distinct, distinct_experts_source=source, distinct_experts_measured=measured,
                       distinct_experts_uniform=uniform, bytes=nbytes,
                       achieved_GBps=gbps["mbu_median"],
                       **{k: v / copy_bw if copy_bw else None for k, v in gbps.items()})
            if b in PROFILED_BATCHES:
                try:
                    row["profile"] = profile_steps(engine, 3)
                    log(f"decode B={b}: {row['profile']['kernels_per_step']:.0f} kernels/step, "
                        f"{row['profile']['kernel_us_per_step'] / 1e3:.2f} ms of kernel time/step")
                except Exception as e:  # a profile is a bonus: never lose the timing over it
                    row["profile"] = {"error": repr(e)}
            out[f"batch_{b}_async" if on else f"batch_{b}"] = row
            log(f"decode B={b} async={on}: {timing['step_s'] * 1e3:.2f} ms/step "
                f"(median {step_s * 1e3:.2f} of {timing['steps_with_model']} model steps), "
                f"{row['tokens_per_s']:.0f} tok/s, MBU {row['mbu_median'] or 0:.1%} "
                f"(mean step: {row['mbu'] or 0:.1%}; experts {distinct:.1f}, {source})")
    finally:
        engine.abort_request(ids)
    return out


def section_offline(run: Run) -> dict[str, Any]:
    n, prompt_len, out_len = run.sizes["offline"]
    prompts = random_prompts(n, prompt_len, run.config.vocab_size, seed=30)
    t, outs = wall(lambda: run.llm.generate(prompts, greedy(out_len), use_tqdm=False))
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": n, "prompt_tokens": n * prompt_len, "output_tokens": generated, "seconds": t,
            "output_tokens_per_s": generated / t, "total_tokens_per_s": (n * prompt_len + generated) / t}


def comparison_prompts(run: Run) -> tuple[list[int], list[int]]:
    vocab, s = run.config.vocab_size, run.sizes
    return random_prompts(1, s["hf_prompt"], vocab, seed=40)[0], random_prompts(1, s["hf_prefill"], vocab, seed=41)[0]


def measure_pair(generate, prefill, s: dict[str, Any]) -> dict[str, Any]:
    """generate(n) -> new token ids; prefill() runs the long prompt. Same protocol for both engines."""
    new, reps = s["hf_new"], max(s["reps"], 2) + 1
    generate(1), generate(4)  # warmup: prefill and decode kernels of these shapes
    one = [wall(lambda: generate(1))[0] for _ in range(reps)]
    many = [wall(lambda: generate(new)) for _ in range(reps)]
    t1, tn = statistics.median(one), statistics.median(t for t, _ in many)
    prefill()
    pre = [wall(prefill)[0] for _ in range(reps)]
    return {"generate_1_s": t1, f"generate_{new}_s": tn, "decode_s_per_token": (tn - t1) / (new - 1),
            "greedy_tokens": list(many[-1][1]), "prefill_tokens": s["hf_prefill"],
            "prefill_s": statistics.median(pre), "prefill_all_s": pre}


def section_compare_deltaserve(run: Run) -> dict[str, Any]:
    short, long = comparison_prompts(run)

    def generate(n: int) -> list[int]:
        return run.llm.generate([{"prompt_token_ids": short}], greedy(n), use_tqdm=False)[0].outputs[0].token_ids

    out = measure_pair(generate, lambda: run.llm.generate([{"prompt_token_ids": long}], greedy(1), use_tqdm=False),
                       run.sizes)
    log(f"deltaserve: {out['decode_s_per_token'] * 1e3:.2f} ms/token, prefill {out['prefill_s']:.3f} s")
    return out


def free_deltaserve(run: Run) -> None:
    if run.llm is not None:
        with contextlib.suppress(Exception):
            run.llm.llm_engine.core.shutdown()
    run.llm = None
    gc.collect()
    torch.cuda.empty_cache()
    run.results["memory_after_free_GiB"] = torch.cuda.memory_allocated() / 2**30
    log(f"deltaserve freed: {run.results['memory_after_free_GiB']:.1f} GiB still allocated")


def section_transformers(run: Run) -> dict[str, Any]:
    import transformers
    from transformers import KimiLinearConfig as HFConfig
    from transformers import KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = run.config
    kwargs = {k: v for k, v in cfg.to_hub_dict().items() if k not in ("architectures", "model_type")}
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = KimiLinearForCausalLM._from_config(HFConfig(**kwargs), dtype=run.dtype, attn_implementation="sdpa")
    held = {"model": model.to_empty(device=run.device)}  # dropped at the end, so the closures below hold no ref
    del model
    prints = run.results.setdefault("weights", {}).setdefault("transformers_fingerprints", {})
    weights = seeded_weights(cfg, run.args.seed, run.dtype, run.device, run.args.weights)
    fill_hf_model(held["model"], cfg, fingerprinted(weights, cfg, prints))
    held["model"].eval().requires_grad_(False)
    experts = getattr(held["model"].config, "_experts_implementation_internal", None)  # grouped_mm on CUDA
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    log(f"transformers: model built in {build_s:.1f} s")
    short, long = comparison_prompts(run)
    short_ids, long_ids = torch.tensor([short], device=run.device), torch.tensor([long], device=run.device)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    @torch.inference_mode()
    def generate(n: int) -> list[int]:  # min_new_tokens keeps EOS away: exactly n new tokens
        seq = held["model"].generate(input_ids=short_ids, attention_mask=torch.ones_like(short_ids),
                                     max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                                     pad_token_id=pad)
        return seq[0, len(short):].tolist()

    @torch.inference_mode()
    def prefill() -> None:
        held["model"](input_ids=long_ids, use_cache=True, logits_to_keep=1)

    try:
        out = measure_pair(generate, prefill, run.sizes)
    finally:
        held.clear()
        gc.collect()
        torch.cuda.empty_cache()
    out.update(model_build_s=build_s, attn_implementation="sdpa", fla_found=importlib.util.find_spec("fla") is not None,
               experts_implementation=experts)
    log(f"transformers: {out['decode_s_per_token'] * 1e3:.2f} ms/token, prefill {out['prefill_s']:.3f} s")
    return out


def comparison(results: dict[str, Any]) -> dict[str, Any]:
    ds, hf = results.get("compare_deltaserve", {}), results.get("transformers", {})
    if "decode_s_per_token" not in ds or "decode_s_per_token" not in hf:
        return {}
    a, b = ds["greedy_tokens"], hf["greedy_tokens"]
    match = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    w = results.get("weights", {})
    return {"decode_speedup": hf["decode_s_per_token"] / ds["decode_s_per_token"],
            "prefill_speedup": hf["prefill_s"] / ds["prefill_s"], "greedy_prefix_match": match,
            "greedy_tokens_compared": min(len(a), len(b)),
            "weights_identical": w.get("deltaserve_fingerprints") == w.get("transformers_fingerprints")}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git(*cmd: str) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # a copy without .git


def metadata(run: Run) -> dict[str, Any]:
    props, gpu, cfg = torch.cuda.get_device_properties(0), torch.cuda.get_device_name(), run.config
    params, status = count_parameters(cfg), git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.date.today().isoformat(), "gpu": gpu, "gpu_memory_GiB": props.total_memory / 2**30,
        "sm_count": props.multi_processor_count, "python": sys.version.split()[0], "torch": torch.__version__,
        "cuda": torch.version.cuda, "triton": version("triton"), "fla-core": version("fla-core"),
        "transformers": version("transformers"), "deltaserve_commit": git("rev-parse", "HEAD"),
        "deltaserve_dirty": None if status is None else bool(status), "preset": run.preset,
        "config": cfg.to_json_dict(),
        "parameters": {"total": params.total, "active_per_token": params.active}, "weight_bytes": weight_bytes(cfg),
        "kda_state_bytes_per_request": kda_state_bytes_per_request(cfg),
        "linear_flops_per_token": linear_flops_per_token(cfg), "lm_head_flops": lm_head_flops(cfg),
        "sizes": run.sizes, "args": vars(run.args),
        "spec_peaks": next((v for k, v in SPEC_PEAKS.items() if k in gpu), None),
    }


def table(results: dict[str, Any]) -> str:
    """One row per measurement, with the goal where there is one."""
    rows = [("section", "measurement", "value", "derived", "goal")]
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"
    c, d, o = (results.get(k, {}) for k in ("ceilings", "decode", "offline"))
    if "copy_GBps" in c:
        rows += [("ceilings", f"copy {c['copy_bytes'] / 2**30:.0f} GiB", f"{c['copy_GBps']:.0f} GB/s", "", ""),
                 ("ceilings", f"bf16 matmul {c['matmul_shape'][0]}^3", f"{c['matmul_TFLOPs']:.0f} TFLOP/s", "", "")]
    prefills = [("prefill", results.get("prefill", {}))] + [
        (f"swiglu {variant}", shapes) for variant, shapes in results.get("swiglu_ab", {}).items()
        if isinstance(shapes, dict)]
    for section, shapes in prefills:
        for key, p in shapes.items():
            if isinstance(p, dict) and "tokens_per_s" in p:
                rows.append((section, key, f"{p['tokens_per_s']:,.0f} tok/s ({p['seconds']:.3f} s)",
                             f"MFU {pct(p['mfu'])}", ">= 40% MFU" if key.startswith("1x") else ""))
    decode_rows = (v for k, v in d.items() if k.startswith("batch_"))
    for r in sorted(decode_rows, key=lambda r: (r["batch"], r.get("async_scheduling", False))):
        kernels = r.get("profile", {}).get("kernel_us_per_step")
        mode = "on" if r.get("async_scheduling") else "off"
        rows.append(("decode", f"B={r['batch']} ctx {r['mean_context']:.0f} async {mode}",
                     f"median {median_step(r) * 1e3:.2f} ms/step, {r['batch'] / median_step(r):,.0f} tok/s",
                     f"MBU {pct(r.get('mbu_median', r['mbu']))} (mean step {pct(r['mbu'])})"
                     + (f", kernels {kernels / 1e3:.2f} ms" if kernels else ""),
                     ">= 60% MBU" if r["batch"] in (1, 64) else ""))
    if "output_tokens_per_s" in o:
        rows.append(("offline", f"{o['requests']} req", f"{o['output_tokens_per_s']:,.0f} out tok/s",
                     f"{o['total_tokens_per_s']:,.0f} total tok/s", ""))
    ds, hf, cm = (results.get(k, {}) for k in ("compare_deltaserve", "transformers", "comparison"))
    if "decode_s_per_token" in ds:
        hf_dec = f", hf {hf['decode_s_per_token'] * 1e3:.2f} ms" if cm else ""
        rows.append(("vs hf", "decode/token B=1", f"ds {ds['decode_s_per_token'] * 1e3:.2f} ms{hf_dec}",
                     f"{cm['decode_speedup']:.1f}x" if cm else "", ">= 5x"))
        rows.append(("vs hf", f"prefill {ds['prefill_tokens']}",
                     f"ds {ds['prefill_s']:.3f} s" + (f", hf {hf['prefill_s']:.3f} s" if cm else ""),
                     f"{cm['prefill_speedup']:.1f}x" if cm else "", ""))
    if cm:
        rows.append(("vs hf", "same weights / greedy match", str(cm["weights_identical"]),
                     f"{cm['greedy_prefix_match']}/{cm['greedy_tokens_compared']} tokens", ""))
    for name, v in results.items():
        if isinstance(v, dict) and ("error" in v or "skipped" in v):
            rows.append((name, "FAILED" if "error" in v else "skipped", (v.get("error") or v["skipped"])[:70], "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default: $OUT or benchmarks/results, h200_<date>.json)")
    p.add_argument("--preset", default=None, help="kimi-linear-48b-a3b (default) or small (--quick's default)")
    p.add_argument("--quick", action="store_true", help="small preset and sizes: a validation run")
    p.add_argument("--skip-transformers", action="store_true", help="skip transformers' model (deltaserve's half runs)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--weights", default="device", choices=("device", "cpu"), help="where random weights are drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="engine option: no CUDA graphs")
    p.add_argument("--decode-batches", default=None, help="comma list of decode batch sizes (default 256,64,16,1)")
    p.add_argument("--async-scheduling", default="off,on", choices=("off", "on", "off,on"),
                   help="decode steps with one step in flight, two, or both")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--time-budget", type=float, default=None, help="seconds after which sections are skipped")
    p.add_argument("--profile-prefill", action="store_true",
                   help="one more prefill of each shape under torch.profiler: kernels by GPU time")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.decode_batches:
        sizes["decode_batches"] = tuple(int(b) for b in args.decode_batches.split(","))
    preset = args.preset or sizes["preset"]
    sizes["profile_prefill"] = args.profile_prefill
    sections = [x.strip() for x in args.only.split(",") if x.strip()]
    if set(sections) - set(SECTIONS) or not torch.cuda.is_available():
        raise SystemExit(f"--only={args.only!r} must list {', '.join(SECTIONS)}; a CUDA device is needed")
    default_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    out = args.out or os.path.join(default_dir, f"h200_{datetime.date.today().isoformat()}.json")
    run = Run(args, sizes, preset_config(preset), out, preset, sections)
    run.results["metadata"] = metadata(run)
    run.save()
    log(f"{run.results['metadata']['gpu']}, preset {preset}, writing {run.out_path}")
    if {"ceilings", "prefill", "swiglu_ab", "decode"} & set(sections):  # MFU and MBU need the ceilings
        run_section(run, "ceilings", section_ceilings)
    engine_sections = [x for x in ("prefill", "swiglu_ab", "decode", "offline") if x in sections]
    if (engine_sections or "transformers" in sections) and run_section(run, "engine", build_deltaserve):
        for name in engine_sections:
            run_section(run, name, globals()[f"section_{name}"])
        if "transformers" in sections:
            run_section(run, "compare_deltaserve", section_compare_deltaserve)
    free_deltaserve(run)
    if "transformers" in sections and not args.skip_transformers:
        run_section(run, "transformers", section_transformers)
    try:  # the autotuned fla configs of this run, to ship in deltaserve/ops/kda/fla_tuned/<GPU>/
        from deltaserve.ops.kda.fla_tuning import dump_autotune_results, gpu_dir_name

        tuned = os.path.join(os.path.dirname(run.out_path), "fla_tuned", gpu_dir_name(torch.cuda.get_device_name(0)))
        log(f"fla autotune results: {dump_autotune_results(tuned)} entries in {tuned}")
    except Exception as e:
        log(f"fla autotune results not written: {e!r}")
    run.results["comparison"] = comparison(run.results)
    run.results["total_seconds"] = time.perf_counter() - START
    run.save()
    log(f"done in {run.results['total_seconds']:.0f} s; results in {run.out_path}")
    print(table(run.results))


if __name__ == "__main__":
    main()
