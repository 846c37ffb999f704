"""GPU check for the grouped-GEMM routed experts on the Kimi-Linear-48B-A3B shape: correctness, timing, capture.

1. correctness: grouped (`deltaserve.ops.moe.grouped`) vs the expert loop (`naive.fused_moe`), both bf16,
   T = 1, 64, 256, 4096; max abs error, max abs error / max |ref|, and ||got - ref|| / ||ref||;
2. CUDA graph: capture the grouped path at T=64, replay it on new inputs and routing, compare to the loop;
3. timing with CUDA events, T = 1 .. 32768 (the loop up to 4096), plus graph replay for T <= 256;
   for each T the bytes of expert weights that must be read (distinct experts routed x 3*H*I*2), the
   achieved GB/s on those bytes, and TFLOP/s (6*T*K*H*I flops).

Routing is uniform random (top-K of random scores), so every expert is hit from about T=512 on.
Writes the rows as JSON to $OUT (or benchmarks/results) and prints a compact table last.

Usage: python benchmarks/gpu_checks/moe.py  (about a minute on an H200; 3.6 GB of expert weights)
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from deltaserve.ops.moe import fused_moe_impl, grouped  # noqa: E402
from deltaserve.ops.moe import naive as moe_naive  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2304, 1024
CHECK_TOKENS = (1, 64, 256, 4096)
TIME_TOKENS = (1, 16, 64, 256, 4096, 32768)
NAIVE_MAX_TOKENS = 4096
GRAPH_MAX_TOKENS = 256
CAPTURE_TOKENS = 64
BF16_REL_TOL = 1e-2


def routing(tokens: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] float32, topk_ids [T, K] long): K distinct uniform experts per token."""
    ids = torch.rand(tokens, EXPERTS, device=dev).topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, device=dev) + 0.1
    return weights, ids


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (got.float() - ref.float()).abs()
    return {
        "max_abs": diff.max().item(),
        "max_rel": (diff.max() / ref.float().abs().max()).item(),
        "norm_rel": ((got.double() - ref.double()).norm() / ref.double().norm()).item(),
    }


def cuda_time(fn: Callable[[], object], max_repeats: int = 20, budget_s: float = 1.0) -> float:
    """Mean seconds per call over up to max_repeats calls (fewer when one call is slow)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(end) / 1e3
    repeats = max(3, min(max_repeats, int(budget_s / max(once, 1e-6))))
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture fn (after a warm-up on a side stream) and return the graph and its static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_capture(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, object]:
    dev = w13.device
    x = torch.randn(CAPTURE_TOKENS, HIDDEN, device=dev).bfloat16()
    weights, ids = routing(CAPTURE_TOKENS, dev)
    try:
        graph, out = capture(lambda: grouped.grouped_fused_moe(x, w13, w2, weights, ids))
    except Exception as exc:  # report, do not stop the timing
        return {"capture": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
    new_weights, new_ids = routing(CAPTURE_TOKENS, dev)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    err = errors(out, moe_naive.fused_moe(x, w13, w2, weights, ids))
    eager = grouped.grouped_fused_moe(x, w13, w2, weights, ids)
    return {"capture": "ok", "replay_vs_loop": err, "replay_equals_eager": bool(torch.equal(out, eager))}


def time_one(tokens: int, w13: torch.Tensor, w2: torch.Tensor, graph_ok: bool) -> dict[str, object]:
    """Timings and rates at one T: grouped eager, grouped graph replay (T <= 256), the loop (T <= 4096)."""
    dev = w13.device
    x = torch.randn(tokens, HIDDEN, device=dev).bfloat16()
    weights, ids = routing(tokens, dev)
    distinct = torch.unique(ids).numel()
    row: dict[str, object] = {
        "tokens": tokens,
        "distinct_experts": distinct,
        "weight_bytes": distinct * 3 * HIDDEN * INTER * w13.element_size(),
        "flops": 6 * tokens * TOP_K * HIDDEN * INTER,
    }
    row["grouped_s"] = cuda_time(lambda: grouped.grouped_fused_moe(x, w13, w2, weights, ids))
    if tokens <= GRAPH_MAX_TOKENS and graph_ok:
        graph, _ = capture(lambda: grouped.grouped_fused_moe(x, w13, w2, weights, ids))
        row["graph_s"] = cuda_time(graph.replay, max_repeats=100)
    if tokens <= NAIVE_MAX_TOKENS:
        row["naive_s"] = cuda_time(lambda: moe_naive.fused_moe(x, w13, w2, weights, ids), max_repeats=10)
    best = min(row.get("graph_s", float("inf")), row["grouped_s"])
    row["grouped_GBps"] = row["weight_bytes"] / best / 1e9
    row["grouped_TFLOPs"] = row["flops"] / row["grouped_s"] / 1e12
    return row


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev) / INTER**0.5).bfloat16()
    probe = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    supported = grouped.grouped_mm_supported(probe, w13, w2)
    header = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inter": INTER, "dtype": "bfloat16"},
        "grouped_supported": supported,
        "dispatch": fused_moe_impl(dev).__module__,
    }
    for k, v in header.items():
        print(f"{k:>18}: {v}")
    if not supported:
        sys.exit("torch._grouped_mm's fast path is not available here (needs sm90/sm100, bf16)")

    checks = []
    for tokens in CHECK_TOKENS:
        x = torch.randn(tokens, HIDDEN, device=dev).bfloat16()
        weights, ids = routing(tokens, dev)
        err = errors(grouped.fused_moe(x, w13, w2, weights, ids), moe_naive.fused_moe(x, w13, w2, weights, ids))
        err["pass"] = err["norm_rel"] < BF16_REL_TOL
        checks.append({"tokens": tokens, **err})
        print(
            f"check T={tokens:>5}: max_abs {err['max_abs']:.3e} max_rel {err['max_rel']:.3e} "
            f"norm_rel {err['norm_rel']:.3e} {'PASS' if err['pass'] else 'FAIL'}"
        )

    graph_check = check_capture(w13, w2)
    print(f"cuda graph capture at T={CAPTURE_TOKENS}: {graph_check}")

    rows = [time_one(tokens, w13, w2, graph_check["capture"] == "ok") for tokens in TIME_TOKENS]

    result = {**header, "checks": checks, "cuda_graph": graph_check, "timing": rows}
    out_dir = os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"
    )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"moe_grouped_{header['date']}_{torch.cuda.get_device_name().replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}\n")

    def ms(v: object) -> str:
        return f"{v * 1e3:9.3f}" if isinstance(v, float) else f"{'-':>9}"

    print(
        f"{'T':>6} {'experts':>7} {'wt MB':>7} {'naive ms':>9} {'grp ms':>9} {'graph ms':>9} "
        f"{'speedup':>7} {'GB/s':>7} {'TFLOP/s':>7}"
    )
    for r in rows:
        best = min(r.get("graph_s", float("inf")), r["grouped_s"])
        speedup = f"{r['naive_s'] / best:7.1f}" if "naive_s" in r else f"{'-':>7}"
        print(
            f"{r['tokens']:>6} {r['distinct_experts']:>7} {r['weight_bytes'] / 1e6:7.0f} {ms(r.get('naive_s'))} "
            f"{ms(r['grouped_s'])} {ms(r.get('graph_s'))} {speedup} {r['grouped_GBps']:7.0f} "
            f"{r['grouped_TFLOPs']:7.1f}"
        )
    status = "PASS" if all(c["pass"] for c in checks) and graph_check["capture"] == "ok" else "FAIL"
    print(f"correctness + capture: {status} (GB/s uses the faster of eager and graph; TFLOP/s uses eager)")


if __name__ == "__main__":
    main()
