"""Host time per decode step: scheduler, SchedulerOutput serialisation and the runner's input preparation.

No model forward runs. For each N x L configuration this builds the engine's own Scheduler,
KVCacheManager, StateSlotPool (and, with prefix caching, PrefixCache and CheckpointPool) the way
EngineCore wires them, adds N requests of L - 1 random prompt tokens and drives the real
schedule() / update_from_output() loop with fake sampled tokens until every request is decoding
with a context of L tokens. The prefill is real scheduling (block tables, hashes, checkpoints are
what a served run would hold); only the forward is skipped and a large per-step token budget
(`--prefill-budget`) lets it finish in a few dozen steps. The budget changes nothing in decode
(N tokens per step, far below it).

Then, per decode step, each part is timed on its own:
  schedule   scheduler.schedule()
  pickle     pickle.dumps(scheduler_output, HIGHEST_PROTOCOL), what crossing a process would cost
             (the size is reported too; unpickling, the receiving side's work, is timed apart over
             the same payloads and reported beside the total, not in it)
  prepare    ModelRunner.prepare(scheduler_output) of a runner built by the Worker for random:tiny
             on CPU. prepare reads only the SchedulerOutput and block_size, never the cache
             tensors, so none are allocated (2.1M blocks at 256 x 128k); the block tables have
             their real length, and that is where the cost is.
  update     scheduler.update_from_output(scheduler_output, sampled)

The scheduler side uses the 48B shape's checkpoint interval and image size and the default
EngineConfig's block size. Requests run nearly in lockstep (contexts L to L + the prefill steps, as
the first prompts decode while the last ones prefill), so on one step in 16 most of them cross a
block boundary together (new block, block hashes, boundary-slot copy): medians hide that step, means
over a multiple of block_size steps include it; both are written, in wall time and in the CPU time
of the main thread (a shared host inflates the first, not the second; process CPU time would count
torch's intra-op threads spinning after their small parallel loops). The cyclic garbage collector runs inside
whichever part allocates when its threshold trips, and traverses the step's fresh lists of block
ids (and, on a full collection, every request's token list), so its CPU time is written as well.

Usage: python benchmarks/host_step_time.py [--configs 64x32768,256x131072] [--prefix-caching both]
To measure a clean commit while the checkout has uncommitted edits, put an export first on the path:
  git archive HEAD deltaserve | tar -x -C /tmp/ds && \
  PYTHONPATH=/tmp/ds python benchmarks/host_step_time.py --source-commit $(git rev-parse HEAD)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time

import torch

import deltaserve
from deltaserve.config.engine_config import EngineConfig
from deltaserve.core.cache_sizing import default_checkpoint_interval, default_unit_bytes
from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.model_files.presets import preset_config
from deltaserve.sampling_params import SamplingParams
from deltaserve.worker.model_runner import ModelRunner
from deltaserve.worker.worker import Worker

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = ("schedule", "pickle", "prepare", "update")


def scheduler_specs(block_size: int) -> tuple[MLALatentSpec, KDAStateSpec]:
    """The 48B shape's cache specs in bfloat16 (the scheduler only uses block_size, the checkpoint
    interval and the image size derived from them)."""
    cfg = preset_config("kimi-linear-48b-a3b")
    kv = MLALatentSpec(block_size, len(cfg.mla_layer_ids), cfg.latent_dim, 2)
    state = KDAStateSpec(len(cfg.kda_layer_ids), cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim,
                         3 * cfg.kda_qkv_dim, cfg.short_conv_kernel_size - 1, 2)
    return kv, state


def build_scheduler(n: int, context: int, max_model_len: int, caching: bool, block_size: int,
                    prefill_budget: int) -> Scheduler:
    """A scheduler with room for n requests of max_model_len tokens, wired as EngineCore wires it."""
    kv_spec, state_spec = scheduler_specs(block_size)
    kv = KVCacheManager(kv_spec, n * kv_spec.blocks_for(max_model_len) + 1, enable_prefix_caching=caching)
    prefix_cache = None
    if caching:
        interval = default_checkpoint_interval(kv_spec, state_spec)
        unit = default_unit_bytes(state_spec.bytes_per_image)
        per_image = -(-state_spec.bytes_per_image // unit)
        units = CheckpointPool(n * (context // interval + 2) * per_image, unit, state_spec.bytes_per_image)
        prefix_cache = PrefixCache(kv, units, interval)
    slots = n * (2 if caching else 1)
    config = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=prefill_budget, max_model_len=max_model_len)
    return Scheduler(config, kv, StateSlotPool(slots), prefix_cache)


def fake_sampled(scheduler: Scheduler, gen: torch.Generator, vocab: int) -> dict[str, int]:
    """A token for every running request (update_from_output uses those whose chunk samples)."""
    ids = [r.request_id for r in scheduler.running]
    return dict(zip(ids, torch.randint(vocab, (len(ids),), generator=gen).tolist(), strict=True))


def run_config(runner: ModelRunner, n: int, context: int, caching: bool, args: argparse.Namespace) -> dict:
    vocab = preset_config("kimi-linear-48b-a3b").vocab_size
    # requests whose prompt is done decode while the later ones still prefill: room for those tokens
    max_model_len = context + 4096
    scheduler = build_scheduler(n, context, max_model_len, caching, args.block_size, args.prefill_budget)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = torch.randint(vocab, (context - 1,), generator=gen).tolist()
        scheduler.add_request(Request(f"req-{i}", prompt, max_tokens=max_model_len, arrival_index=i,
                                      sampling_params=SamplingParams(ignore_eos=True)))

    t0, prefill_steps = time.perf_counter(), 0
    with torch.inference_mode():
        while scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
            out = scheduler.schedule()
            runner.prepare(out)  # every step reaches the runner, as in serving
            scheduler.update_from_output(out, fake_sampled(scheduler, gen, vocab))
            prefill_steps += 1
            del out
        setup_s = time.perf_counter() - t0
        assert scheduler.num_running == n, f"{scheduler.num_running} of {n} requests running after the prefill"
        contexts = [r.num_tokens for r in scheduler.running]

        wall: dict[str, list[float]] = {p: [] for p in (*PARTS, "unpickle")}
        cpu: dict[str, list[float]] = {p: [] for p in (*PARTS, "unpickle")}
        gc_ms: dict[str, list[float]] = {p: [] for p in (*PARTS, "unpickle")}
        gc.callbacks.append(_GC)
        sizes, scheduled, blocks, payloads = [], [], [], []
        for step in range(args.warmup + args.steps):
            marks = [_now()]
            out = scheduler.schedule()
            marks.append(_now())
            payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
            marks.append(_now())
            runner.prepare(out)
            marks.append(_now())
            sampled = fake_sampled(scheduler, gen, vocab)
            marks.append(_now())
            finished = scheduler.update_from_output(out, sampled).finished
            marks.append(_now())
            assert not finished and scheduler.num_running == n, "a request finished or was preempted"
            if step >= args.warmup:
                # (part, index of the mark that starts it); each part ends at the next mark
                for part, i in (("schedule", 0), ("pickle", 1), ("prepare", 2), ("update", 4)):
                    _record(part, marks[i], marks[i + 1], wall, cpu, gc_ms)
                sizes.append(len(payload))
                scheduled.append(out.num_scheduled_tokens)
                blocks.append(max(len(b) for b in _block_tables(scheduler)))
                payloads.append(payload)
            del out, payload
        # unpickling is the receiving process's work: timed apart, so its lists do not move the
        # garbage collector's runs into or out of the step's parts
        for payload in payloads:
            start = _now()
            pickle.loads(payload)
            _record("unpickle", start, _now(), wall, cpu, gc_ms)
        del payloads
        gc.callbacks.remove(_GC)

    row = {
        "num_requests": n,
        "context": context,
        "prefix_caching": caching,
        "prefill_steps": prefill_steps,
        "setup_s": setup_s,
        "context_min": min(contexts),  # at the first decode step (early prompts decoded during the prefill)
        "context_max": max(contexts),
        "scheduled_tokens_per_step": statistics.median(scheduled),
        "blocks_per_request_max": statistics.median(blocks),
        "pickle_bytes_median": statistics.median(sizes),
    }
    for clock, times in (("wall", wall), ("cpu", cpu), ("gc", gc_ms)):
        totals = [sum(times[p][i] for p in PARTS) for i in range(args.steps)]
        for part, values in (*times.items(), ("total", totals)):
            row[f"{part}_{clock}_ms_median"] = statistics.median(values)
            row[f"{part}_{clock}_ms_mean"] = statistics.fmean(values)
            row[f"{part}_{clock}_ms_max"] = max(values)
    return row


class _GCClock:
    """Main-thread CPU seconds spent in the cyclic garbage collector (it runs inside whichever part
    allocates when its threshold trips)."""

    def __init__(self) -> None:
        self.total, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.total += time.thread_time() - self._start


_GC = _GCClock()


def _now() -> tuple[float, float, float]:
    """Wall, main-thread CPU and garbage-collector CPU seconds."""
    return time.perf_counter(), time.thread_time(), _GC.total


def _record(part: str, start: tuple, end: tuple, *series: dict[str, list[float]]) -> None:
    """Append end - start in ms, per clock (wall, cpu, gc), to each series' list for `part`."""
    for i, times in enumerate(series):
        times[part].append((end[i] - start[i]) * 1e3)


def _block_tables(scheduler: Scheduler):
    return (scheduler.kv_cache_manager.block_ids(r.request_id) for r in scheduler.running)


def tiny_runner(block_size: int) -> ModelRunner:
    """The ModelRunner the Worker builds for random:tiny on CPU (no caches allocated: prepare reads none)."""
    config = EngineConfig(model="random:tiny", device="cpu", block_size=block_size)
    worker = Worker(config, preset_config("tiny"), "random:tiny")
    worker.load_model()
    return worker.runner


def machine(source_commit: str | None) -> dict:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def git(*cmd: str) -> str:
        # --no-optional-locks: read the tree without refreshing the index
        return subprocess.run(["git", "--no-optional-locks", *cmd], cwd=HERE, capture_output=True, text=True).stdout

    source = os.path.dirname(os.path.dirname(os.path.abspath(deltaserve.__file__)))
    in_repo = os.path.samefile(source, git("rev-parse", "--show-toplevel").strip() or HERE)
    modified = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {
        "host": platform.platform(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "git_commit": source_commit or (git("rev-parse", "HEAD").strip() if in_repo else None),
        # the checkout's uncommitted files count only when deltaserve was imported from the checkout
        "deltaserve_path": source,
        "git_modified": modified if in_repo else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="64x32768,256x131072", help="N x L pairs, comma-separated")
    parser.add_argument("--prefix-caching", choices=("off", "on", "both"), default="both")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps (a multiple of block_size)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=EngineConfig().block_size)
    parser.add_argument("--prefill-budget", type=int, default=1 << 20, help="max_num_batched_tokens")
    parser.add_argument("--source-commit", default=None,
                        help="the commit deltaserve was exported from, when it is not imported from this checkout")
    parser.add_argument("--out", default=None, help="JSON path (default results/host_step_time_<date>_cpu.json)")
    args = parser.parse_args()

    runner = tiny_runner(args.block_size)
    caching = {"off": [False], "on": [True], "both": [False, True]}[args.prefix_caching]
    rows = []
    header = (f"{'config':>10} {'cache':>5} {'sched ms':>8} {'update ms':>9} {'pickle ms':>9} {'pickle MB':>9} "
              f"{'prep ms':>8} {'total ms':>8} {'mean ms':>8} {'cpu ms':>8} {'gc ms':>7} {'unpkl ms':>8}")
    print("Wall-time medians per decode step. mean: of the total; cpu: median main-thread CPU time of the total; "
          "gc: mean CPU time in the garbage collector, inside the total; unpkl: pickle.loads, not in the total",
          flush=True)
    print(header, flush=True)
    for pair in args.configs.split(","):
        n, context = (int(x) for x in pair.lower().split("x"))
        for c in caching:
            row = run_config(runner, n, context, c, args)
            rows.append(row)
            m = {k: row[f"{k}_wall_ms_median"] for k in (*PARTS, "total", "unpickle")}
            print(f"{pair:>10} {'on' if c else 'off':>5} {m['schedule']:8.2f} {m['update']:9.2f} {m['pickle']:9.2f} "
                  f"{row['pickle_bytes_median'] / 1e6:9.2f} {m['prepare']:8.2f} {m['total']:8.2f} "
                  f"{row['total_wall_ms_mean']:8.2f} {row['total_cpu_ms_median']:8.2f} {row['total_gc_ms_mean']:7.2f} "
                  f"{m['unpickle']:8.2f}",
                  flush=True)
            gc.collect()

    today = datetime.date.today().isoformat()
    result = {
        "date": today,
        **machine(args.source_commit),
        "what": "host ms per decode step: schedule + pickle.dumps(SchedulerOutput) + ModelRunner.prepare + "
                "update_from_output (total; unpickle beside it), no forward; medians, means and maxima over the "
                "timed steps, in wall time, main-thread CPU time and garbage-collector CPU time",
        "args": vars(args),
        "goal_ms": {"64x32768": 1.0, "256x131072": 3.0},
        "rows": rows,
    }
    path = args.out or os.path.join(HERE, "results", f"host_step_time_{today}_cpu.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
