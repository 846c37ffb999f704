"""Synthetic agentic multi-turn workload through the engine, prefix caching on vs off.

Sessions share a long system prompt and tool list; each turn appends the model's previous answer
and a tool result, so contexts grow turn by turn. All sessions' turns of one round run concurrently.
Prints, per mode: prompt tokens, the oracle (what an infinite cache could reuse: for each request the
longest block-aligned prefix it shares with any earlier request's prompt + output, never its last
token), tokens hit, tokens computed, mean / p90 TTFT and total time. Writes JSON to benchmarks/results/.

Usage: python benchmarks/agentic.py [--sessions 4] [--turns 6] [--system 4000] [--tool 1500] [--answer 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import tempfile
import time

import torch

from deltaserve import LLM, SamplingParams

BLOCK = 16


def oracle_tokens(history: list[list[int]], prompt: list[int]) -> int:
    best = 0
    for seen in history:
        n = 0
        limit = min(len(seen), len(prompt) - 1)
        while n < limit and seen[n] == prompt[n]:
            n += 1
        best = max(best, n // BLOCK * BLOCK)
    return best


def run(mode_caching: bool, args: argparse.Namespace) -> dict:
    llm = LLM(
        model=args.model, dtype="float32", device=args.device, block_size=BLOCK, enable_prefix_caching=mode_caching,
        max_num_batched_tokens=args.budget, cache_memory=args.cache_memory, max_model_len=args.max_model_len,
    )
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size - 8

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(args.system)
    prompts = [system + tokens(200) for _ in range(args.sessions)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    history: list[list[int]] = []
    ttfts, oracle, prompt_tokens, hits = [], 0, 0, 0
    started = time.perf_counter()
    for turn in range(args.turns):
        t0 = time.perf_counter()
        first_token: dict[str, float] = {}
        outputs = {}
        for s, p in enumerate(prompts):
            oracle += oracle_tokens(history, p)
            prompt_tokens += len(p)
            engine.add_request(f"t{turn}s{s}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                first_token.setdefault(out.request_id, time.perf_counter() - t0)
                if out.finished:
                    outputs[out.request_id] = out
        ttfts.extend(first_token.values())
        new_prompts = []
        for s, p in enumerate(prompts):
            out = outputs[f"t{turn}s{s}"]
            hits += out.num_cached_tokens
            history.append(p + out.outputs[0].token_ids)
            new_prompts.append(p + out.outputs[0].token_ids + tokens(args.tool))
        prompts = new_prompts
    total = time.perf_counter() - started
    metrics = llm.get_metrics()
    ttfts.sort()
    return {
        "prefix_caching": mode_caching,
        "requests": args.sessions * args.turns,
        "prompt_tokens": prompt_tokens,
        "oracle_tokens": oracle,
        "hit_tokens": hits,
        "hit_vs_oracle": hits / oracle if oracle else 0.0,
        "computed_tokens": metrics["scheduler"]["computed_tokens"],
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "total_s": total,
        "max_context": max(len(h) for h in history),
        "metrics": metrics,
    }


def long_context_tiny(max_len: int, preset: str = "tiny") -> str:
    """The preset's weights (tiny by default) with `model_max_length` raised: the model has no
    positional encoding."""
    from deltaserve.model_files.make_model import make_model

    out = os.path.join(tempfile.gettempdir(), f"deltaserve-{preset}-{max_len}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        make_model(preset, out, seed=0)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["model_max_length"] = max_len
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=1200, help="shared system prompt + tools, tokens")
    parser.add_argument("--tool", type=int, default=350, help="tool result appended each turn, tokens")
    parser.add_argument("--answer", type=int, default=48, help="generated tokens per turn")
    parser.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    parser.add_argument("--cache-memory", default="256MiB")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--model", default="random:tiny", help="checkpoint dir (default: the random tiny preset)")
    parser.add_argument("--long-context", type=int, default=None,
                        help="make a tiny-preset copy whose context limit is this many tokens (NoPE: only a limit)")
    args = parser.parse_args()
    if args.long_context:
        args.model = long_context_tiny(args.long_context)
    rows = [run(True, args), run(False, args)]
    result = {
        "date": datetime.date.today().isoformat(),
        "host": platform.platform(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "args": vars(args),
        "rows": rows,
    }
    name = f"agentic_{result['date']}{'_long' if args.long_context else ''}.json"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    print(f"{'caching':>8} {'prompt':>8} {'oracle':>8} {'hit':>8} {'hit/orc':>7} {'computed':>9} "
          f"{'ttft_mean':>9} {'ttft_p90':>9} {'total_s':>8}")
    for r in rows:
        print(f"{'on' if r['prefix_caching'] else 'off':>8} {r['prompt_tokens']:>8} {r['oracle_tokens']:>8} "
              f"{r['hit_tokens']:>8} {r['hit_vs_oracle']:>7.3f} {r['computed_tokens']:>9} "
              f"{r['ttft_mean_s']:>9.3f} {r['ttft_p90_s']:>9.3f} {r['total_s']:>8.2f}")


if __name__ == "__main__":
    main()
