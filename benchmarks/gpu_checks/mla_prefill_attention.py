"""GPU check of MLA prefill attention on the Kimi-Linear shape: which kernel takes V of 128 against the
192-wide QK fastest, and how much the zero padding of V to 192 costs (issue 20, prefill MFU).

Per layer and TP rank: H = 32 heads, q/k head size 192 (128 nope + 64 rope), v head size 128, bf16.
Shapes: one 32k prompt, one 4k prompt, and a 2k chunk over 14k of cached context (the bottom-right
causal mask). Variants:
- `padded`: what the engine runs (`ops.mla.prefill.attention_sdpa`: V padded to 192, SDPA's choice);
- `padded_<backend>`, `dv128_<backend>`: SDPA with V padded or not, the backend forced (flash, efficient,
  cudnn); a backend that refuses the shape is recorded as its error;
- `flex_dv128`: torch.compile'd flex_attention with V of 128 and a causal block mask.

Each variant's output is compared with `padded` (max abs difference) and timed with CUDA events, median
of --iters after warm-up. TFLOP/s counts the causal work: 2 * H * (192 + 128) per (query, visible key).
Then the cost of a shape never seen before (a serving engine's prefill chunks rarely repeat their
(new tokens, keys) pair; cuDNN builds an execution plan per shape): for `padded`, `padded_flash` and
`dv128_cudnn`, the wall time of the first and the second call at each of --fresh-shapes new shapes, with
and without cached context.
Writes $OUT/mla_prefill_attention_<date>.json (or benchmarks/results/) and prints a table last.

Usage: python benchmarks/gpu_checks/mla_prefill_attention.py [--iters 10] [--no-flex] [--fresh-shapes 4]
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
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# runnable as a script from a checkout without an installed deltaserve
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from deltaserve.ops.mla.prefill import attention_sdpa  # noqa: E402

HEADS, QK_DIM, V_DIM = 32, 192, 128
SCALE = QK_DIM**-0.5
SHAPES = {"1x32768": (32768, 0), "1x4096": (4096, 0), "2048_after_14336": (2048, 14336)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def causal_flops(n: int, num_context: int) -> float:
    visible = n * num_context + n * (n + 1) / 2
    return 2.0 * HEADS * (QK_DIM + V_DIM) * visible


def sdpa_variant(backend: SDPBackend, pad: bool) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int) -> torch.Tensor:
        n, num_keys = q.shape[0], k.shape[0]
        if pad:
            v = F.pad(v, (0, QK_DIM - V_DIM))
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        with sdpa_kernel([backend]):
            if num_context == 0:
                out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=SCALE)
            else:
                out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, num_keys),
                                                     scale=SCALE)
        return out[0, :, :, :V_DIM].transpose(0, 1)
    return run


def flex_variant() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict[tuple[int, int], object] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int) -> torch.Tensor:
        n, num_keys = q.shape[0], k.shape[0]
        if (n, num_keys) not in masks:
            def causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202  (flex's mask_mod signature)
                return kv_idx <= q_idx + num_context
            masks[(n, num_keys)] = create_block_mask(causal, None, None, n, num_keys, device=q.device)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = compiled(qh, kh, vh, block_mask=masks[(n, num_keys)], scale=SCALE)
        return out[0].transpose(0, 1)
    return run


def time_ms(fn: Callable[..., torch.Tensor], inputs: tuple, iters: int) -> float:
    for _ in range(2):
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def first_and_second_call_ms(fn: Callable[..., torch.Tensor], n: int, num_context: int,
                             device: torch.device) -> tuple[float, float]:
    """Wall ms of the first and the second call of `fn` at a (new tokens, context) shape."""
    q = torch.randn(n, HEADS, QK_DIM, device=device, dtype=torch.bfloat16)
    k = torch.randn(num_context + n, HEADS, QK_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn(num_context + n, HEADS, 2 * V_DIM, device=device, dtype=torch.bfloat16)[..., V_DIM:]
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(q, k, v, num_context)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--fresh-shapes", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "padded": lambda q, k, v, c: attention_sdpa(q, k, v, SCALE, c)}
    for name, backend in BACKENDS.items():
        variants[f"padded_{name}"] = sdpa_variant(backend, pad=True)
        variants[f"dv128_{name}"] = sdpa_variant(backend, pad=False)
    if not args.no_flex:
        variants["flex_dv128"] = flex_variant()

    results: dict[str, dict[str, dict]] = {}
    for shape, (n, num_context) in SHAPES.items():
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(n, HEADS, QK_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(num_context + n, HEADS, QK_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        # V as the engine holds it: a strided view into the expanded [L, H, 128 + 128] kv_b_proj output
        kv = torch.randn(num_context + n, HEADS, 2 * V_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        v = kv[..., V_DIM:]
        reference = variants["padded"](q, k, v, num_context).float()
        flops = causal_flops(n, num_context)
        results[shape] = {}
        for name, fn in variants.items():
            row: dict = {}
            try:
                out = fn(q, k, v, num_context)
                row["max_abs_diff"] = (out.float() - reference).abs().max().item()
                row["ms"] = time_ms(fn, (q, k, v, num_context), args.iters)
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001 — a backend refusing a shape is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            results[shape][name] = row
            torch.cuda.empty_cache()

    fresh: dict[str, list[dict]] = {}
    for index, name in enumerate(("padded", "padded_flash", "dv128_cudnn")):
        fresh[name] = []
        for i in range(args.fresh_shapes):
            for num_context in (0, 6000 + 101 * i):
                n = 1500 + 97 * i + 13 * index  # distinct per variant, never a shape timed above
                first, second = first_and_second_call_ms(variants[name], n, num_context, device)
                fresh[name].append({"new_tokens": n, "context": num_context, "first_ms": first, "second_ms": second})

    report = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "heads": HEADS, "qk_dim": QK_DIM, "v_dim": V_DIM, "iters": args.iters,
        "shapes": {s: {"new_tokens": n, "context": c} for s, (n, c) in SHAPES.items()}, "results": results,
        "fresh_shapes": fresh,
    }
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    path = os.path.join(out_dir, f"mla_prefill_attention_{report['date']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    print(f"{'variant':<20}" + "".join(f"{s:>28}" for s in SHAPES))
    for name in variants:
        cells = []
        for shape in SHAPES:
            row = results[shape][name]
            cells.append(f"{'error':>28}" if "error" in row else
                         f"{row['ms']:9.2f} ms {row['tflops']:6.0f} TF/s d={row['max_abs_diff']:.0e}")
        print(f"{name:<20}" + "".join(f"{c:>28}" for c in cells))
    for name, rows in fresh.items():
        print(f"fresh shapes, {name}: first call ms " + " ".join(f"{r['first_ms']:.1f}" for r in rows)
              + "; second " + " ".join(f"{r['second_ms']:.1f}" for r in rows))
    for shape in SHAPES:
        for name, row in results[shape].items():
            if "error" in row:
                print(f"{shape} {name}: {row['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
