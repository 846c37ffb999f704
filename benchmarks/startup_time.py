"""A fresh process's startup, with fla's shipped autotune configs and without them (issue 20).

Each run is a new Python process (nothing tuned or compiled in memory) that builds an engine and serves
one prompt: the wall time to import, to build the engine (weights, cache sizing, CUDA graph capture)
and to serve the first request (a prefill of --prompt-len tokens through fla's chunked kernels, then a
few decode steps). Modes:
  shipped: the configs in deltaserve/ops/kda/fla_tuned/<GPU>/ (what a user gets; none for a GPU that
           has no directory, which then tunes).
  tune:    an empty FLA_CONFIG_DIR in strict mode, so every fla kernel autotunes as on a machine without
           shipped configs; its chosen configs are written to --dump-dir/<GPU>/ to ship.
The child also names the Triton kernels that benchmarked their configs in it (fla's and ours), so a
missing shipped file shows by name.

Usage (on the device, after `. benchmarks/device_setup.sh`):
  python benchmarks/startup_time.py --model random:kimi-linear-48b-a3b --modes tune,shipped --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args: argparse.Namespace) -> None:
    """One fresh process: time the phases, print one JSON line."""
    started = time.perf_counter()
    import torch

    from deltaserve import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.prompt_len + 64,
              max_num_batched_tokens=max(8192, args.prompt_len), max_num_seqs=args.max_num_seqs,
              cache_memory=args.cache_memory)
    built = time.perf_counter()
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = [(7 * i + 3) % (vocab - 10) + 5 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    torch.cuda.synchronize()
    served = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt[::-1]}], params, use_tqdm=False)
    torch.cuda.synchronize()
    again = time.perf_counter()
    # every Triton autotuner that benchmarked its configs in this process (a shipped file skips that)
    from triton.runtime.autotuner import Autotuner

    tuned = sorted({getattr(t, "kernel_name", None) or t.fn.__name__ for t in gc.get_objects()
                    if isinstance(t, Autotuner) and getattr(t, "configs_timings", None)})
    dumped = 0
    if args.dump_dir:
        from deltaserve.ops.kda.fla_tuning import dump_autotune_results, gpu_dir_name

        dumped = dump_autotune_results(os.path.join(args.dump_dir, gpu_dir_name(torch.cuda.get_device_name(0))))
    print("RESULT " + json.dumps({
        "import_s": imported - started, "engine_s": built - imported, "first_request_s": served - built,
        "second_request_s": again - served, "total_s": served - started,
        "fla_config_dir": os.environ.get("FLA_CONFIG_DIR"), "kernels_autotuned": tuned,
        "entries_dumped": dumped, "device": torch.cuda.get_device_name(0),
    }), flush=True)


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    env = dict(os.environ)
    env.pop("FLA_CONFIG_DIR", None)
    env.pop("FLA_CACHE_MODE", None)
    extra = []
    empty = None
    if mode == "tune":
        empty = tempfile.mkdtemp(prefix="fla_empty_")
        env["FLA_CONFIG_DIR"], env["FLA_CACHE_MODE"] = empty, "strict"
        if args.dump_dir:
            extra = ["--dump-dir", args.dump_dir]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--prompt-len",
           str(args.prompt_len), "--max-num-seqs", str(args.max_num_seqs), *extra]
    if args.cache_memory:
        cmd += ["--cache-memory", args.cache_memory]
    wall = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - wall
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"mode": mode, "error": proc.stderr[-2000:], "returncode": proc.returncode, "wall_s": wall}
    return {"mode": mode, "wall_s": wall, **json.loads(lines[-1][len("RESULT "):])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:kimi-linear-48b-a3b")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cache-memory", default=None)
    parser.add_argument("--modes", default="tune,shipped")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=420)
    parser.add_argument("--dump-dir", default=None, help="tune mode: write the tuned configs here, per GPU")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    print(f"{'mode':>8} {'import s':>9} {'engine s':>9} {'1st req s':>10} {'2nd req s':>10} {'wall s':>8}", flush=True)
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            row = run_mode(args, mode)
            rows.append(row)
            if "error" in row:
                print(f"{mode:>8} failed (rc {row['returncode']}): {row['error'][-600:]}", flush=True)
                continue
            print(f"{mode:>8} {row['import_s']:9.1f} {row['engine_s']:9.1f} {row['first_request_s']:10.1f} "
                  f"{row['second_request_s']:10.2f} {row['wall_s']:8.1f}  autotuned: {row['kernels_autotuned']}",
                  flush=True)
    today = datetime.date.today().isoformat()
    path = args.out or os.path.join(HERE, "results", f"startup_time_{today}.json")
    with open(path, "w") as f:
        json.dump({"date": today, "args": vars(args), "rows": rows,
                   "what": "a fresh process per row: import, engine build (incl. CUDA graph capture), the first "
                           "request (prefill of prompt_len + 8 decode steps) and a second one, wall seconds"},
                  f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
