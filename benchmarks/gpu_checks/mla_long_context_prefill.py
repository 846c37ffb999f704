"""GPU check of one MLA layer's prefill chunk after a long cached context (the 48B shape, bf16, TP 1):
the context expanded to K/V in one pass against in pieces of EXPANSION_GROUP_TOKENS merged by log-sum-exp
(`MultiheadLatentAttention._attend_long_context`). Agentic traffic resumes conversations of up to 1M
tokens; one pass holds the whole context's K/V (about 42 KB a token at 32 heads), pieces one piece's.

For each context length: the layer's output difference between the two ways, the median time of
--iters forwards after warm-up (CUDA events, `mla_prefill_attention.time_ms`) and the peak memory one
forward adds above what was allocated before it. A way that runs out of memory is recorded as such.
Writes $OUT/mla_long_context_prefill_<date>.json (or benchmarks/results/) and prints a table last.

Usage: python benchmarks/gpu_checks/mla_long_context_prefill.py [--chunk 8192] [--contexts 16384,131072]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

# runnable as a script from a checkout without an installed deltaserve
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from deltaserve.config.parallel import ParallelConfig  # noqa: E402
from deltaserve.model.forward_context import (  # noqa: E402
    ForwardContext,  # noqa: E402
    PrefillSequence,
    no_prefill_fields,
    set_forward_context,
)
from deltaserve.model.layers import mla  # noqa: E402
from deltaserve.model_files.presets import preset_config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_prefill_attention import time_ms  # noqa: E402  (CUDA-event median after warm-up)

BLOCK_SIZE = 64
PIECES = mla.EXPANSION_GROUP_TOKENS
ONE_PASS = 1 << 40


def build_layer(device: torch.device) -> mla.MultiheadLatentAttention:
    config = preset_config("kimi-linear-48b-a3b")
    layer = mla.MultiheadLatentAttention(config, ParallelConfig(), torch.bfloat16).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            if param.dim() > 1:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return layer


def forward_once(layer: mla.MultiheadLatentAttention, x: torch.Tensor, num_context: int) -> torch.Tensor:
    device, n = x.device, x.shape[0]
    positions = torch.arange(num_context, num_context + n, device=device)
    block_ids = torch.arange(-(-(num_context + n) // BLOCK_SIZE), device=device)
    fields = no_prefill_fields(device)
    fields.update(prefill_cu_seqlens=torch.tensor([0, n], device=device),
                  prefill_sequences=(PrefillSequence(0, n, num_context, block_ids),))
    ctx = ForwardContext(num_tokens=n, num_decodes=0, slot_mapping=positions,
                         decode_state_slots=torch.zeros(0, dtype=torch.long, device=device),
                         decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
                         decode_seq_lens=torch.zeros(0, dtype=torch.long, device=device), **fields)
    with set_forward_context(ctx), torch.inference_mode():
        return layer(x)


def measure(layer: mla.MultiheadLatentAttention, x: torch.Tensor, num_context: int, pieces: int,
            iters: int) -> tuple[dict, torch.Tensor | None]:
    mla.EXPANSION_GROUP_TOKENS = pieces
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        out = forward_once(layer, x, num_context)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        ms = time_ms(forward_once, (layer, x, num_context), iters)
    except torch.OutOfMemoryError as exc:
        return {"error": f"OutOfMemoryError: {str(exc).splitlines()[0][:160]}"}, None
    finally:
        mla.EXPANSION_GROUP_TOKENS = PIECES
    return {"ms": ms, "peak_gib": peak / 2**30}, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--contexts", default="16384,65536,131072,262144,1048576")
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    layer = build_layer(device)
    contexts = [int(c) for c in args.contexts.split(",")]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.chunk, layer.o_proj.out_features, device=device, dtype=torch.bfloat16, generator=gen)
    results = []
    for num_context in contexts:
        blocks = -(-(num_context + args.chunk) // BLOCK_SIZE)
        layer.bind_cache(None)
        torch.cuda.empty_cache()
        cache = torch.randn(blocks, BLOCK_SIZE, layer.kv_lora_rank + layer.rope_dim, device=device,
                            dtype=torch.bfloat16, generator=gen)
        layer.bind_cache(cache)
        pieces_row, pieces_out = measure(layer, x, num_context, PIECES, args.iters)
        one_row, one_out = measure(layer, x, num_context, ONE_PASS, args.iters)
        diff = None
        if pieces_out is not None and one_out is not None:
            diff = (pieces_out.float() - one_out.float()).abs().max().item()
        results.append({"context": num_context, "chunk": args.chunk, "pieces": pieces_row, "one_pass": one_row,
                        "max_abs_diff": diff, "cache_gib": cache.numel() * 2 / 2**30})
        del cache, pieces_out, one_out
    report = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "piece_tokens": PIECES, "block_size": BLOCK_SIZE,
              "heads": layer.num_heads, "results": results}
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    path = os.path.join(out_dir, f"mla_long_context_prefill_{report['date']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")

    def cell(row: dict) -> str:
        return "OOM" if "error" in row else f"{row['ms']:8.1f} ms {row['peak_gib']:6.2f} GiB"

    print(f"{'context':>9} {'pieces':>22} {'one pass':>22} {'max diff':>9}")
    for r in results:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        print(f"{r['context']:>9} {cell(r['pieces']):>22} {cell(r['one_pass']):>22} {diff:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
