"""Where and why greedy tokens on the GPU (float32) part from the CPU's, on the tiny parity configs.

Each variant runs in its own process (Triton reads TRITON_F32_DEFAULT when it compiles), on the same
checkpoints and prompts as tests/test_parity.py:
  cpu           the references on the CPU (the oracle);
  gpu           the GPU path as shipped (fla KDA, Triton MLA decode, Triton norms and conv);
  gpu-ieee      the same with TRITON_F32_DEFAULT=ieee: fp32 dots in Triton kernels without tf32;
  gpu-torchkda  the GPU path with DELTASERVE_KDA_BACKEND=torch (KDA through the references on the GPU).
For every prompt the parent prints the first step where a variant's token differs from the CPU's, the
CPU's top-1 / top-2 logprob margin at that step (a near-tie if small), and the largest logprob
difference before it. Usage: python benchmarks/gpu_checks/parity_probe.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "cpu": {},
    "gpu": {},
    "gpu-ieee": {"TRITON_F32_DEFAULT": "ieee"},
    "gpu-torchkda": {"DELTASERVE_KDA_BACKEND": "torch"},
}
NUM_TOKENS, TOP = 32, 5


def tune_with_first_config() -> None:
    """Skip autotuning: each Triton autotuner runs the first config that survives pruning.

    Autotuning fla for a new shape takes minutes; the config changes tiling, not precision.
    """
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, *a, **kw: prune(self, *a, **kw)[:1]


def child(variant: str, model_dir: str, prompts_path: str, out_path: str) -> None:
    from deltaserve import LLM, SamplingParams

    if variant != "cpu" and os.environ.get("PROBE_FIRST_CONFIG") == "1":
        tune_with_first_config()

    prompts = json.loads(Path(prompts_path).read_text())
    device = "cpu" if variant == "cpu" else "cuda"
    kwargs = {} if device == "cpu" else {"cache_memory": "256MiB", "max_num_seqs": 16}
    llm = LLM(model=model_dir, dtype="float32", device=device, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"tokens": c.token_ids,
                     "top": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]})
    Path(out_path).write_text(json.dumps(rows))
    if device == "cuda" and os.environ.get("FLA_TUNED_OUT"):  # this shape's fla autotune results, to ship
        from deltaserve.ops.kda.fla_tuning import dump_autotune_results

        dump_autotune_results(os.environ["FLA_TUNED_OUT"])


def compare(ref: list[dict], got: list[dict], lengths: list[int]) -> list[dict]:
    report = []
    for n, r, g in zip(lengths, ref, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"], strict=True)) if a != b), None)
        upto = len(r["tokens"]) if first is None else first
        diffs = [abs(r["top"][i][str(t)] - g["top"][i][str(t)]) for i, t in enumerate(r["tokens"][:upto])]
        margin = None
        if first is not None:
            top2 = sorted(r["top"][first].values(), reverse=True)[:2]
            margin = top2[0] - top2[1] if len(top2) == 2 else None
        report.append({"prompt_len": n, "first_divergence": first, "cpu_margin_there": margin,
                       "max_logprob_diff_before": max(diffs, default=0.0)})
    return report


def print_rows(name: str, by_variant: dict) -> None:
    for variant, rows in by_variant.items():
        for row in rows:
            first = "-" if row["first_divergence"] is None else row["first_divergence"]
            margin = "" if row["cpu_margin_there"] is None else f"{row['cpu_margin_there']:.2e}"
            print(f"{name:14} {variant:13} {row['prompt_len']:>4} {first!s:>11} {margin:>10} "
                  f"{row['max_logprob_diff_before']:>16.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="plain,qlora-groups,shared2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="cpu is always run")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from hf_reference import build_hf_model, random_prompts, save_hf_checkpoint
    from test_parity import CONFIGS, PROMPT_LENGTHS

    results: dict = {}
    print(f"{'config':14} {'variant':13} {'len':>4} {'diverges at':>11} {'cpu margin':>10} {'max dlogp before':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            hub_config, seed = CONFIGS[name]
            model_dir = save_hf_checkpoint(build_hf_model(hub_config, seed), os.path.join(tmp, name))
            prompts_path = os.path.join(tmp, f"{name}.prompts.json")
            Path(prompts_path).write_text(json.dumps(random_prompts(PROMPT_LENGTHS, hub_config["vocab_size"], seed)))
            runs = {}
            chosen = {"cpu"} | set(args.variants.split(","))
            for variant, env in ((v, e) for v, e in VARIANTS.items() if v in chosen):
                out_path = os.path.join(tmp, f"{name}.{variant}.json")
                done = subprocess.run(
                    [sys.executable, __file__, "--child", variant, model_dir, prompts_path, out_path],
                    env={**os.environ, **env}, capture_output=True, text=True, timeout=900,
                )
                if done.returncode:
                    runs[variant] = {"error": done.stderr[-3000:]}
                    print(f"{name}/{variant} failed:\n{done.stderr[-3000:]}", flush=True)
                    continue
                runs[variant] = json.loads(Path(out_path).read_text())
            results[name] = {v: compare(runs["cpu"], runs[v], PROMPT_LENGTHS)
                             for v in runs if v != "cpu" and "error" not in runs[v] and "error" not in runs["cpu"]}
            print_rows(name, results[name])
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
    else:
        main()
