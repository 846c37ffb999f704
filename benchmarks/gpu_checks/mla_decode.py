"""GPU check of the Triton paged MLA decode on the Kimi-Linear shape: correctness, then timing.

Shape per layer and TP rank: H = 32 heads, R = kv_lora_rank = 512, P = rope dim = 64, bf16 cache and
queries, block_size 16, block tables over shuffled blocks.

1. Correctness against `naive.paged_mla_decode` (fp32 math) for B in 1, 16, 64, 256 at ragged
   lengths up to 4096 and B = 1 at 32k: NaN in every cache slot no sequence owns, out-of-range ids
   past each table's used blocks. Also the fp32-cache path once.
2. Timing (CUDA events, L2 flushed before every launch, median of --iters): eager calls and the same
   call captured in a CUDA graph (graph time = GPU time without Python launch gaps). Bytes are the
   cached latents actually read (sum of seq_len * (R + P) * 2) plus q; GB/s = bytes / graph time.
3. Sweeps (skip with --no-sweep): tile configs and num_kv_splits, to tune DEFAULT_CONFIG and
   choose_num_kv_splits.

Writes $OUT/mla_decode_<date>.json (or benchmarks/results/ without $OUT) with date, device and
versions, and prints the summary table last. Exit status 1 if a correctness check fails.

Usage: python benchmarks/gpu_checks/mla_decode.py [--iters 50] [--no-sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton

# runnable as `python benchmarks/gpu_checks/mla_decode.py` from a checkout without an installed deltaserve
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from deltaserve.ops.mla import naive, triton_decode  # noqa: E402

HEADS, RANK, ROPE, BLOCK_SIZE = 32, 512, 64, 16
SCALE = (128 + 64) ** -0.5
# bf16: the softmax weights are rounded to bf16 (2^-9 relative) for the value dot, so o can be off by
# up to ~2^-9 * max|c| (~1e-2 for randn latents); scores, and so lse, are exact fp32 sums
O_TOL, LSE_TOL = 2e-2, 1e-3  # |err| <= tol + tol * |ref|
FP32_TOL = 1e-4
DEVICE = torch.device("cuda")


def make_batch(
    seq_lens: list[int], *, dtype: torch.dtype = torch.bfloat16, poison: bool = True, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q_latent [B, H, R], q_pe [B, H, P], kv_cache [num_blocks, 16, R + P], block_tables [B, max_blocks]
    (2 garbage columns), seq_lens [B], all on the GPU; each sequence in randomly permuted blocks."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    batch = len(seq_lens)
    pages = [-(-n // BLOCK_SIZE) for n in seq_lens]
    max_pages = max(pages) + 2
    num_blocks = sum(pages) + 8
    width = RANK + ROPE
    if poison:
        cache = torch.full((num_blocks, BLOCK_SIZE, width), float("nan"), dtype=dtype, device=DEVICE)
    else:
        cache = torch.empty((num_blocks, BLOCK_SIZE, width), dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    tables = torch.randint(num_blocks, 2**40, (batch, max_pages), generator=gen, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=DEVICE)
    starts = torch.tensor([0] + pages[:-1], device=DEVICE).cumsum(0)
    column = torch.arange(max_pages, device=DEVICE)
    used = column[None, :] < torch.tensor(pages, device=DEVICE)[:, None]
    owned = perm[(starts[:, None] + column[None, :]).clamp(max=num_blocks - 1)]
    tables = torch.where(used, owned, tables)
    # write random latents into exactly the slots below each seq_len
    positions = torch.arange(max_pages * BLOCK_SIZE, device=DEVICE)
    valid = positions[None, :] < lens[:, None]
    slots = tables.gather(1, (positions // BLOCK_SIZE).expand(batch, -1).clamp(max=max_pages - 1)) * BLOCK_SIZE
    slots = (slots + positions % BLOCK_SIZE)[valid]
    flat = cache.view(-1, width)
    flat[slots] = torch.randn(slots.numel(), width, generator=gen, device=DEVICE).to(dtype)
    q_latent = torch.randn(batch, HEADS, RANK, generator=gen, device=DEVICE).to(dtype)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=gen, device=DEVICE).to(dtype)
    return q_latent, q_pe, cache, tables, lens


def check(seq_lens: list[int], dtype: torch.dtype = torch.bfloat16, **kwargs) -> dict:
    case = make_batch(seq_lens, dtype=dtype, seed=len(seq_lens))
    o, lse = triton_decode.paged_mla_decode(*case, SCALE, RANK, **kwargs)
    ref_o, ref_lse = naive.paged_mla_decode(*case, SCALE, RANK)
    finite = torch.isfinite(ref_lse)
    o_err = (o - ref_o).abs().max().item()
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    empty_ok = bool(torch.isneginf(lse[~finite]).all()) and bool((o[~finite] == 0).all())
    o_tol, lse_tol = (O_TOL, LSE_TOL) if dtype == torch.bfloat16 else (FP32_TOL, FP32_TOL)
    o_ok = bool(((o - ref_o).abs() <= o_tol * (1 + ref_o.abs())).all())  # NaN fails too
    lse_ok = bool(((lse - ref_lse).abs() <= lse_tol * (1 + ref_lse.abs()))[finite].all())
    ok = o_ok and lse_ok and empty_ok
    del case, ref_o, ref_lse
    torch.cuda.empty_cache()
    return {
        "batch": len(seq_lens),
        "max_len": max(seq_lens),
        "dtype": str(dtype).removeprefix("torch."),
        "options": {k: str(v) for k, v in kwargs.items()},
        "o_max_abs_err": o_err,
        "lse_max_abs_err": lse_err,
        "ok": ok,
    }


class Timer:
    """Median GPU time of fn with L2 flushed before each launch, eager and replayed from a CUDA graph."""

    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)  # > H200's L2

    def _median_us(self, launch: Callable[[], object]) -> float:
        events = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in events)

    def eager_us(self, fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        return self._median_us(fn)

    def call_us(self, fn: Callable[[], object], calls: int = 100) -> float:
        """Wall time per call, back to back, warm L2: max(host launch cost, GPU time)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    def graph_us(self, fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm the allocator on a side stream, as capture wants
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        return self._median_us(graph.replay)


def touched_bytes(case: tuple[torch.Tensor, ...]) -> int:
    q_latent, q_pe, cache, _, lens = case
    cache_bytes = int(lens.sum().item()) * cache.shape[-1] * cache.element_size()
    return cache_bytes + q_latent.numel() * q_latent.element_size() + q_pe.numel() * q_pe.element_size()


def time_case(
    timer: Timer,
    batch: int,
    context: int,
    *,
    num_kv_splits: int | None = None,
    config: triton_decode.DecodeConfig | None = None,
) -> dict:
    case = make_batch([context] * batch, poison=False, seed=batch)
    block_h = (config or triton_decode.DEFAULT_CONFIG).block_h
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    # the split count the default path would pick (max_seq_len = table capacity), made explicit
    splits = num_kv_splits or triton_decode.choose_num_kv_splits(
        batch, triton.cdiv(HEADS, block_h), case[3].shape[1] * BLOCK_SIZE, num_sms
    )

    def fn() -> object:
        return triton_decode.paged_mla_decode(*case, SCALE, RANK, num_kv_splits=splits, config=config)

    row = {"batch": batch, "context": context, "splits": splits}
    try:
        row["eager_us"] = timer.eager_us(fn)
        row["graph_us"] = timer.graph_us(fn)
        row["call_us"] = timer.call_us(fn)
    except Exception as exc:  # a sweep config the GPU cannot launch (shared memory, registers)
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return row
    row["bytes"] = touched_bytes(case)
    row["GBps"] = row["bytes"] / (row["graph_us"] * 1e-6) / 1e9
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-sweep", action="store_true", help="skip the config and split sweeps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's einsums in true fp32
    gen = torch.Generator().manual_seed(0)

    def ragged(batch: int, top: int) -> list[int]:
        lens = torch.randint(1, top + 1, (batch,), generator=gen).tolist()
        lens[0] = top
        if batch > 2:
            lens[1] = 0  # an empty sequence
        return lens

    checks = [check(ragged(b, 4096)) for b in (1, 16, 64, 256)]
    checks.append(check([32768]))
    checks.append(check(ragged(16, 4096), num_kv_splits=1))
    checks.append(check(ragged(16, 4096), num_kv_splits=64))
    checks.append(check(ragged(8, 2048), dtype=torch.float32))
    print(f"correctness done in {time.perf_counter() - t0:.1f}s", flush=True)

    timer = Timer(args.iters)
    timings = [time_case(timer, b, 4096) for b in (1, 16, 64, 256)]
    timings += [time_case(timer, 1, 32768), time_case(timer, 16, 32768)]
    naive_case = make_batch([4096] * 16, poison=False, seed=16)
    naive_us = timer.eager_us(lambda: naive.paged_mla_decode(*naive_case, SCALE, RANK))
    print(f"timing done in {time.perf_counter() - t0:.1f}s", flush=True)

    config_sweep, split_sweep = [], []
    if not args.no_sweep:
        configs = [
            (16, 32, 4, 2),
            (16, 16, 4, 2),
            (16, 16, 4, 3),
            (16, 32, 8, 2),
            (16, 64, 8, 2),
            (32, 16, 8, 3),
            (32, 32, 8, 2),
        ]
        for block_h, block_n, warps, stages in configs:
            cfg = triton_decode.DecodeConfig(block_h, block_n, warps, stages)
            for batch, context in ((1, 32768), (16, 4096), (64, 4096), (256, 4096)):
                row = time_case(timer, batch, context, config=cfg)
                config_sweep.append({"config": [block_h, block_n, warps, stages], **row})
        for batch, context in ((1, 32768), (1, 4096), (16, 4096), (64, 4096)):
            for splits in (1, 2, 4, 8, 16, 32, 64):
                split_sweep.append(time_case(timer, batch, context, num_kv_splits=splits))
        print(f"sweeps done in {time.perf_counter() - t0:.1f}s", flush=True)

    props = torch.cuda.get_device_properties(DEVICE)
    report = {
        "date": datetime.date.today().isoformat(),
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "block_size": BLOCK_SIZE, "dtype": "bf16"},
        "default_config": vars(triton_decode.DEFAULT_CONFIG),
        "correctness": checks,
        "timings": timings,
        "naive_us_B16_ctx4096": naive_us,
        "config_sweep": config_sweep,
        "split_sweep": split_sweep,
        "wall_s": time.perf_counter() - t0,
    }
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"mla_decode_{report['date']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)

    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}; wrote {path}")
    if split_sweep:
        print("\nnum_kv_splits sweep (graph us):")
        for batch, context in sorted({(r["batch"], r["context"]) for r in split_sweep}):
            rows = [r for r in split_sweep if (r["batch"], r["context"]) == (batch, context)]
            cells = " ".join(f"{r['splits']}:{r.get('graph_us', float('nan')):.1f}" for r in rows)
            print(f"  B={batch:<4} ctx={context:<6} {cells}")
    if config_sweep:
        print("\nconfig sweep [block_h, block_n, warps, stages] (graph us at B/ctx 1/32k 16/4k 64/4k 256/4k):")
        for cfg in sorted({tuple(r["config"]) for r in config_sweep}):
            rows = [r for r in config_sweep if tuple(r["config"]) == cfg]
            cells = " ".join(f"{r['graph_us']:8.1f}" if "graph_us" in r else "  failed" for r in rows)
            print(f"  {list(cfg)!s:<18} {cells}")
    print(f"\ncorrectness (|err| <= tol * (1 + |ref|); bf16 tol o {O_TOL}, lse {LSE_TOL}; fp32 {FP32_TOL}):")
    for c in checks:
        flag = "ok  " if c["ok"] else "FAIL"
        print(
            f"  {flag} B={c['batch']:<4} max_len={c['max_len']:<6} {c['dtype']:<8} {c['options'] or ''} "
            f"o_err={c['o_max_abs_err']:.2e} lse_err={c['lse_max_abs_err']:.2e}"
        )
    print(f"\nnaive reference B=16 ctx=4096: {naive_us:.1f} us (eager)")
    print("\nL2 flushed before each launch; GB/s from graph us; call us = back-to-back wall time per call, warm L2")
    head = f"{'B':>4} {'context':>8} {'splits':>6} {'eager us':>9} {'graph us':>9} {'call us':>8} {'MB read':>8}"
    print(f"{head} {'GB/s':>7} {'%4.8TB/s':>8}")
    for r in timings:
        if "error" in r:
            print(f"{r['batch']:>4} {r['context']:>8} {r['splits']:>6}  {r['error']}")
            continue
        print(
            f"{r['batch']:>4} {r['context']:>8} {r['splits']:>6} {r['eager_us']:>9.1f} {r['graph_us']:>9.1f} "
            f"{r['call_us']:>8.1f} {r['bytes'] / 1e6:>8.1f} {r['GBps']:>7.0f} {r['GBps'] / 48:>7.0f}%"
        )
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
