"""The gain side of speculative decoding on the trained default models (issue 19): acceptance per position,
mean acceptance length and output tokens/s with speculation off and on, per method, at each batch size.

Prompts are the accuracy gate's held-out windows (`reference.json`: the first --prompt-len tokens of each)
and, for a copy-heavy workload, the same prompts written out twice (n-gram lookup's best case). Every run
is greedy, and its tokens are checked against the run without speculation (lossless) before they count;
in bfloat16 (where a verify pass and a decode step round differently, so a near-tie may go either way) the
share of leading tokens that agree is reported instead (`tokens_agreeing`).
tok/s is output tokens over the wall time of `LLM.generate`, after an untimed warm-up of every workload and
batch size per engine (on a GPU, fla autotunes each new shape on first use: seconds, not decode time).

Usage (the default trained target, draft and eagle3 head; CPU or GPU):
  python benchmarks/spec_acceptance.py --batches 1,16 --k 3
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time

import torch
from host_step_time import machine

from deltaserve import LLM, SamplingParams
from deltaserve.eval.reference import load_reference
from deltaserve.model_files.default_model import installed_trained_dir, reference_path

HERE = os.path.dirname(os.path.abspath(__file__))


def methods(k: int) -> dict[str, dict | None]:
    return {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "draft_model": {"method": "draft_model", "model": installed_trained_dir("draft"), "num_speculative_tokens": k},
        "eagle3": {"method": "eagle3", "model": installed_trained_dir("eagle3"), "num_speculative_tokens": k},
    }


def chosen_methods(names: str, k: int) -> dict[str, dict | None]:
    """The methods named in `names` (comma-separated), in `methods`' order; an unknown name is refused."""
    known = methods(k)
    wanted = set(names.split(","))
    if wanted - set(known):
        raise SystemExit(f"unknown --methods {sorted(wanted - set(known))}; known: {list(known)}")
    return {name: spec for name, spec in known.items() if name in wanted}


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - started


def agreeing(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy completions share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def trained_model_args(description: str, extra: dict[str, dict] | None = None) -> argparse.Namespace:
    """The options of the benchmarks on the trained default models (this one, eagle3_draft_time.py and
    spec_step_profile.py); `extra`: more options, {flag: add_argument keywords}."""
    parser = argparse.ArgumentParser(description=description)
    for flag, options in (extra or {}).items():
        parser.add_argument(flag, **options)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cache-memory", default="1GiB", help="each engine's cache budget")
    parser.add_argument("--methods", default="off,ngram,draft_model,eagle3",
                        help="comma-separated; 'off' (the baseline) is always run first")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def held_out_prompts(prompt_len: int) -> list[list[int]]:
    """The accuracy gate's held-out windows, the first prompt_len tokens of each."""
    return [w[:prompt_len] for w in load_reference(reference_path()).inputs.windows]


def main() -> None:
    args = trained_model_args(__doc__.split("\n")[0])
    natural = held_out_prompts(args.prompt_len)
    workloads = {"natural": natural, "copy": [p + p for p in natural]}
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    print(f"{'workload':>8} {'method':>11} {'batch':>5} {'tok/s':>8} {'speedup':>7} {'accept':>6} {'mean len':>8} "
          "per position", flush=True)
    for method, spec in chosen_methods("off," + args.methods, args.k).items():  # the baseline first, always
        llm = LLM(dtype=args.dtype, device=args.device, speculative_config=spec, max_num_seqs=max(batches),
                  cache_memory=args.cache_memory)
        for prompts in workloads.values():  # warm-up: every shape the timed runs meet, on reversed prompts
            for batch in batches:           # (no prefix hits for the timed runs)
                run(llm, [prompts[i % len(prompts)][::-1] for i in range(batch)], 8)
        for workload, prompts in workloads.items():
            for batch in batches:
                chosen = [prompts[i % len(prompts)] for i in range(batch)]
                before = llm.get_metrics().get("spec_decode")
                tokens, seconds = run(llm, chosen, args.max_tokens)
                after = llm.get_metrics().get("spec_decode")
                key = (workload, batch)
                row = {"workload": workload, "method": method, "batch": batch,
                       "tok_per_s": batch * args.max_tokens / seconds, "tokens": tokens}
                if after is not None:
                    drafts = after["num_drafts"] - before["num_drafts"]
                    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                    per_pos = [a - (before["accepted_per_position"][j] if j < len(before["accepted_per_position"])
                                    else 0) for j, a in enumerate(after["accepted_per_position"])]
                    row.update(num_drafts=drafts, acceptance_rate=accepted / drafted if drafted else 0.0,
                               mean_acceptance_length=1 + accepted / drafts if drafts else 1.0,
                               accepted_per_position=[p / drafts if drafts else 0.0 for p in per_pos])
                rows.append(row)
                base = next(r for r in rows if r["method"] == "off" and (r["workload"], r["batch"]) == key)
                same = sum(agreeing(a, b) for a, b in zip(row["tokens"], base["tokens"], strict=True))
                row["tokens_agreeing"] = same / (batch * args.max_tokens)
                if row["tokens"] != base["tokens"] and args.dtype == "float32":
                    raise SystemExit(f"{method} {workload} batch {batch}: tokens differ from the run without "
                                     "speculation (greedy must be lossless)")
                row["speedup"] = row["tok_per_s"] / base["tok_per_s"]
                per_position = " ".join(f"{p:.2f}" for p in row.get("accepted_per_position", []))
                print(f"{workload:>8} {method:>11} {batch:>5} {row['tok_per_s']:8.1f} {row['speedup']:7.2f} "
                      f"{row.get('acceptance_rate', 0):6.2f} {row.get('mean_acceptance_length', 1):8.2f} "
                      f"{per_position}  agree {row['tokens_agreeing']:.2f}", flush=True)
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its caches from what is free
    for row in rows:
        del row["tokens"]
    today = datetime.date.today().isoformat()
    info = machine(None)
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    result = {"date": today, **info, "args": vars(args), "rows": rows,
              "what": "greedy outputs of the trained default target with speculation off and on (checked equal); "
                      "acceptance per position = share of verify windows whose draft j was accepted"}
    path = args.out or os.path.join(HERE, "results", f"spec_acceptance_{today}_{info['device'].split()[0]}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
