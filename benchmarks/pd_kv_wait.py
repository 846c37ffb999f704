"""How long a decode request waits for its KV under prefill/decode disaggregation, on CPU loopback.

For each transfer backend (nixl, mooncake) and parallel layout, a producer engine and a consumer engine
run in this process (their ranks as processes under the "mp" executor), as in
tests/kv_transfer/test_pd_engine.py and test_pd_parallel.py. Per prompt length and repeat the producer
prefills a fresh prompt of random token ids (max_tokens=1, do_remote_decode; prefix caching off on both
sides, so nothing is reused), then the consumer gets the decode leg through `LLMEngine.add_request` and
is stepped with `step()`. Timed with time.perf_counter from add_request (admission):
  kv_wait       until the step whose output carries the producer's first token: every consumer rank
                has reported its load finished (the request left WAITING_FOR_REMOTE_KVS)
  first_decode  until the step whose output carries the first token the consumer sampled itself
  prefill       the producer's add_request until its finished output (for context)
The engine keeps no per-request load time of its own (its _Timing has arrival and first-scheduled
times only), so these are the numbers. The time this process's cyclic garbage collector spends inside
kv_wait is recorded beside it (gc.callbacks): a full pass walks every live prompt-length token list.
The consumer runs kv_load_failure_policy="fail": a failed load ends the run instead of being timed as
a recompute.

Bytes and descriptors per request: the ops each consumer rank posts, from `pairing.request_ops` over the
layouts the ranks registered (`executor.kv_layouts()`) and the block ids and state slot of the request's
LoadSpec (captured on the consumer's scheduler side), which is what `KVConnectorWorker._start` posts.
With a one-rank consumer the agent's `read` and `poll` are also wrapped: the ops it was handed are
counted (measured, checked against the computed ones) and the wait is split into admission -> read
posted, the read call itself (descriptor lists, post), post -> the worker's poll seeing it done, and done
-> the engine's output. Descriptors with staging (one per destination page per MLA layer) and the
per-token path's count are also computed by `kv_transfer.topology.plan_topology`; the ops every
consumer rank actually posted are counted by the consumer engine (`ops posted`), which is the measured
figure for the staged layout (`pp2_to_tp2_dcp2_staged4` and `_staged64`: the producer stages 4 or 64 pages per chunk).

The model is the tiny preset with its context limit raised (benchmarks/agentic.py's long_context_tiny,
float32). Each engine pair's first request (a short prompt, reported apart) pays the side-channel
handshake and add_peer. On CPU the prefill runs the naive MLA attention (materialised scores), so a
65536-token prefill takes minutes: `--repeats` takes one count per prompt length and
`--parallel-max-len` skips long prompts on the multi-rank layouts.

Usage:
  python benchmarks/pd_kv_wait.py --repeats 3,2       # what results/pd_kv_wait_2026-12-06_cpu.json ran (12.5 min)
  python benchmarks/pd_kv_wait.py --backends nixl --layouts tp1_to_tp1 --prompt-lens 8192 --repeats 3
  python benchmarks/pd_kv_wait.py --layouts pp2_to_tp2_dcp2_staged4,pp2_to_tp2_dcp2_staged64,pp2_to_tp2_dcp2 \
      --prompt-lens 8192,65536 --repeats 3,1 \
      --out benchmarks/results/pd_kv_wait_2026-12-06_cpu_staged.json       # the staged rows
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import random
import statistics
import time
from typing import Any

from agentic import long_context_tiny
from host_step_time import machine
from transfer_bandwidth import library_version

from deltaserve import LLM, SamplingParams
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.kv_transfer import TransferAgent, TransferOp, available_backends
from deltaserve.kv_transfer.layout import RankLayout
from deltaserve.kv_transfer.metadata import LoadSpec
from deltaserve.kv_transfer.pairing import pair_ranks, request_ops
from deltaserve.kv_transfer.topology import DTYPE_BYTES, EngineTopology, TransferSettings, plan_topology

HERE = os.path.dirname(os.path.abspath(__file__))
CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
# name -> (producer sizes, consumer sizes)
LAYOUTS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "tp1_to_tp1": ({}, {}),
    "pp2_to_tp2_dcp2": ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
    "pp2_to_tp2_dcp2_staged4": ({"pipeline_parallel_size": 2},
                                {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
    "pp2_to_tp2_dcp2_staged64": ({"pipeline_parallel_size": 2},
                                 {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
}
# layouts whose producer stages MLA for the DCP consumer: pages per staging chunk
STAGING_CHUNK_PAGES = {"pp2_to_tp2_dcp2_staged4": 4, "pp2_to_tp2_dcp2_staged64": 64}
WARMUP_TOKENS = 256


def topology_of(sizes: dict[str, int]) -> EngineTopology:
    return EngineTopology(tp=sizes.get("tensor_parallel_size", 1), pp=sizes.get("pipeline_parallel_size", 1),
                          dcp=sizes.get("decode_context_parallel_size", 1))


class ReadLog:
    """Wraps a one-rank consumer's transfer agent: each read's ops, bytes and times (perf_counter)."""

    def __init__(self, agent: TransferAgent) -> None:
        self.entries: list[dict[str, Any]] = []
        by_handle: dict[int, dict[str, Any]] = {}
        read, poll = agent.read, agent.poll

        def timed_read(peer: str, ops: list[TransferOp]):
            start = time.perf_counter()
            handle = read(peer, ops)
            entry = {"posted_at": start, "read_call_s": time.perf_counter() - start, "num_ops": len(ops),
                     "nbytes": sum(op[2] for op in ops), "done_at": None}
            self.entries.append(entry)
            by_handle[id(handle)] = entry
            return handle

        def timed_poll(handle) -> bool:
            done = poll(handle)
            entry = by_handle.get(id(handle))
            if done and entry is not None and entry["done_at"] is None:
                entry["done_at"] = time.perf_counter()
            return done

        agent.read, agent.poll = timed_read, timed_poll  # instance attributes: the library's code is untouched


class GCLog:
    """The cyclic garbage collector's passes in this process (gc.callbacks): (generation, start, seconds)."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((info["generation"], self._start, time.perf_counter() - self._start))

    def __enter__(self) -> GCLog:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self)

    def before(self, moment: float) -> tuple[float, int]:
        """Seconds in passes that started before `moment`, and how many of them were full (generation 2)."""
        early = [p for p in self.passes if p[1] < moment]
        return sum(p[2] for p in early), sum(1 for p in early if p[0] == 2)


def posted_ops(producer: list[RankLayout], consumer: list[RankLayout], spec: LoadSpec) -> dict[str, Any]:
    """The reads every consumer rank posts for `spec`, as `KVConnectorWorker._start` builds them, split
    into MLA latents and KDA state: descriptors, bytes and READ calls (one per producer rank read)."""
    source = spec.source
    args = (spec.block_ids, source.block_ids, source.block_size, spec.state_slot, source.state_slot, source.num_tokens)
    ranks = []
    for local in consumer:
        pairing = pair_ranks(local, producer)
        mla = request_ops(dataclasses.replace(pairing, kda_source={}), *args)
        kda = request_ops(dataclasses.replace(pairing, mla_source={}), *args)
        reads = sum(1 for key in pairing.sources if mla[key] or kda[key])
        ranks.append({
            "tp_rank": local.tp_rank, "dcp_rank": local.dcp_rank, "reads": reads,
            "mla_descriptors": sum(len(ops) for ops in mla.values()),
            "mla_bytes": sum(op[2] for ops in mla.values() for op in ops),
            "kda_descriptors": sum(len(ops) for ops in kda.values()),
            "kda_bytes": sum(op[2] for ops in kda.values() for op in ops),
        })
    totals = {k: sum(r[k] for r in ranks) for k in ("reads", "mla_descriptors", "mla_bytes", "kda_descriptors",
                                                      "kda_bytes")}
    return {**totals, "descriptors": totals["mla_descriptors"] + totals["kda_descriptors"],
            "bytes": totals["mla_bytes"] + totals["kda_bytes"], "per_rank": ranks}


def drain(engine: LLMEngine) -> None:
    while engine.has_work_without_requests():
        engine.step()


def prefill(engine: LLMEngine, request_id: str, ids: list[int]) -> tuple[float, dict[str, Any]]:
    """Seconds from add_request to the finished output, and the kv_transfer_params it carries."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                seconds = time.perf_counter() - start
                drain(engine)
                if out.kv_transfer_params is None:
                    raise RuntimeError(f"prefill of {request_id} finished without kv_transfer_params")
                return seconds, out.kv_transfer_params
    raise RuntimeError(f"prefill of {request_id}: the producer ran out of work before it finished")


def decode(engine: LLMEngine, request_id: str, ids: list[int], transfer: dict[str, Any]) -> dict[str, Any]:
    """The decode leg (two tokens: the producer's, then one sampled here), timed from add_request."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                            extra_args={"kv_transfer_params": transfer})
    with GCLog() as gc_log:
        start = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        loaded_at, decoded_at, steps_to_load = step_until_decoded(engine, request_id)
    drain(engine)
    gc_s, full_passes = gc_log.before(loaded_at)
    return {"admitted_at": start, "loaded_at": loaded_at, "kv_wait_s": loaded_at - start,
            "first_decode_s": decoded_at - start, "steps_to_load": steps_to_load, "gc_in_kv_wait_s": gc_s,
            "full_gc_in_kv_wait": full_passes}


def step_until_decoded(engine: LLMEngine, request_id: str) -> tuple[float, float, int]:
    """Steps the consumer until `request_id` has its first decoded token: (when its load finished,
    when it decoded, steps until the load finished)."""
    loaded_at = decoded_at = None
    steps = steps_to_load = 0
    while decoded_at is None:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"decode of {request_id}: the consumer ran out of work before its first decode")
        outputs = engine.step()
        now, steps = time.perf_counter(), steps + 1
        for out in outputs:
            if out.request_id != request_id:
                continue
            num_tokens = len(out.outputs[0].token_ids)
            if out.finished and num_tokens < 2:
                raise RuntimeError(f"decode of {request_id} ended after {num_tokens} tokens: "
                                   f"{out.outputs[0].finish_reason} ({out.outputs[0].stop_reason})")
            if num_tokens >= 1 and loaded_at is None:
                loaded_at, steps_to_load = now, steps
            if num_tokens >= 2:
                decoded_at = now
    assert loaded_at is not None
    return loaded_at, decoded_at, steps_to_load


def settle(producer: LLMEngine, timeout_s: float = 30.0) -> None:
    """Waits for the consumer's releases to free the producer's held request (and, under chunked
    transfer, its stream entry)."""
    core = producer.core
    deadline = time.monotonic() + timeout_s
    while core.scheduler.held_for_transfer or core.kv_transfer.scheduler.streams:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the producer still holds {sorted(core.scheduler.held_for_transfer)} after "
                               f"{timeout_s} s: a consumer rank did not release it")
        time.sleep(0.005)
        core.poll_transfers()


def split_wait(decoded: dict[str, Any], reads: list[dict[str, Any]]) -> dict[str, float]:
    """A one-rank consumer's kv_wait in parts (seconds): admission -> read posted, inside read, read
    posted -> the worker's poll saw it done, done -> the engine's output."""
    posted = min(r["posted_at"] for r in reads)
    done = max(r["done_at"] for r in reads)
    return {"admit_to_post_s": posted - decoded["admitted_at"], "read_call_s": sum(r["read_call_s"] for r in reads),
            "post_to_done_s": done - posted, "done_to_output_s": decoded["loaded_at"] - done}


def ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def bench_pair(backend: str, layout: str, prompt_lens: list[int], repeats: dict[int, int], common: dict[str, Any],
               rng: random.Random) -> dict[str, Any]:
    """Builds the producer and consumer of `layout` over `backend`, runs every prompt length; rows out."""
    producer_sizes, consumer_sizes = LAYOUTS[layout]
    mp = {"distributed_executor_backend": "mp"}
    connector = CONNECTORS[backend]
    producer = consumer = None
    try:
        start = time.perf_counter()
        producer = LLM(**{**common, **producer_sizes, **(mp if producer_sizes else {})},
                       kv_transfer_config={"kv_connector": connector, "kv_role": "kv_producer",
                                           "staging_chunk_pages": STAGING_CHUNK_PAGES.get(layout, 0)})
        consumer = LLM(**{**common, **consumer_sizes, **(mp if consumer_sizes else {})},
                       kv_transfer_config={"kv_connector": connector, "kv_role": "kv_consumer",
                                           "kv_load_failure_policy": "fail"})
        startup_s = time.perf_counter() - start
        p_engine, c_engine = producer.llm_engine, consumer.llm_engine
        specs: dict[str, LoadSpec] = {}
        connector_side = c_engine.core.kv_transfer.scheduler
        add_load = connector_side.add_load

        def capture(load: LoadSpec) -> None:
            specs[load.request_id] = load
            add_load(load)

        connector_side.add_load = capture
        worker = getattr(c_engine.executor, "worker", None)  # the uniproc executor's own worker
        read_log = ReadLog(worker.kv_connector.agent) if worker is not None else None
        vocab = p_engine.model_config.vocab_size
        dtype_bytes = DTYPE_BYTES[p_engine.executor.dtype_name]
        p_layouts, c_layouts = p_engine.executor.kv_layouts(), c_engine.executor.kv_layouts()
        prefix = f"{backend}-{layout}"

        def one(request_id: str, num_tokens: int) -> tuple[float, dict[str, Any], list[dict[str, Any]]]:
            ids = [rng.randrange(vocab) for _ in range(num_tokens)]
            prefill_s, transfer = prefill(p_engine, request_id, ids)
            if read_log is not None:
                read_log.entries.clear()
            counters = c_engine.core.kv_transfer
            ops_before, chunks_before = counters.num_ops, counters.num_staged_chunks
            decoded = decode(c_engine, request_id, ids, transfer)
            decoded["engine_ops_posted"] = counters.num_ops - ops_before  # every rank's, as the engine counts them
            decoded["staged_chunks"] = counters.num_staged_chunks - chunks_before
            settle(p_engine)
            return prefill_s, decoded, list(read_log.entries) if read_log is not None else []

        _, warm, _ = one(f"{prefix}-warmup", WARMUP_TOKENS)
        print(f"{backend:9s} {layout:24s} engines up in {startup_s:.1f} s; first request ({WARMUP_TOKENS} tokens, "
              f"handshake) kv_wait {warm['kv_wait_s'] * 1e3:.1f} ms", flush=True)
        rows = []
        for num_tokens in prompt_lens:
            runs = []
            for repeat in range(repeats[num_tokens]):
                request_id = f"{prefix}-{num_tokens}-{repeat}"
                prefill_s, decoded, reads = one(request_id, num_tokens)
                posted = posted_ops(p_layouts, c_layouts, specs.pop(request_id))  # the per-token path's
                run = {"prefill_s": prefill_s, **decoded, "posted": posted}
                if read_log is not None:
                    measured = {"reads": len(reads), "descriptors": sum(r["num_ops"] for r in reads),
                                "bytes": sum(r["nbytes"] for r in reads)}
                    if measured != {k: posted[k] for k in measured}:
                        raise RuntimeError(f"{request_id}: the agent was handed {measured}, request_ops computes "
                                           f"{ {k: posted[k] for k in measured} }")
                    run["split"] = split_wait(decoded, reads)
                runs.append(run)
                print(f"{backend:9s} {layout:24s} {num_tokens:6d} tokens #{repeat}: prefill {prefill_s:7.2f} s  "
                      f"kv_wait {decoded['kv_wait_s'] * 1e3:8.2f} ms  first decode "
                      f"{decoded['first_decode_s'] * 1e3:8.2f} ms  ({decoded['steps_to_load']} steps, gc "
                      f"{decoded['gc_in_kv_wait_s'] * 1e3:.1f} ms)", flush=True)
            rows.append(summarise(backend, layout, num_tokens, runs, dtype_bytes, p_engine, c_engine))
        return {"startup_s": round(startup_s, 2), "first_request_kv_wait_ms": round(warm["kv_wait_s"] * 1e3, 3),
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    finally:
        for llm in (consumer, producer):
            if llm is not None:
                llm.llm_engine.shutdown()


def summarise(backend: str, layout: str, num_tokens: int, runs: list[dict[str, Any]], dtype_bytes: int,
              producer: LLMEngine, consumer: LLMEngine) -> dict[str, Any]:
    """One result row: medians of the runs, the posted ops (identical across runs) and the topology's figures."""
    producer_sizes, consumer_sizes = LAYOUTS[layout]
    settings = TransferSettings(block_size=producer.config.scheduler_block_size,
                                decode_block_size=consumer.config.block_size,
                                dcp_interleave=consumer.config.dcp_kv_cache_interleave_size,
                                prompt_tokens=num_tokens, dtype_bytes=dtype_bytes)
    plan = plan_topology(producer.model_config, topology_of(producer_sizes), topology_of(consumer_sizes), settings)
    plan.raise_if_refused()
    cost = plan.cost
    assert cost is not None
    posted = runs[-1]["posted"]
    kv_wait = [r["kv_wait_s"] for r in runs]
    row = {
        "backend": backend, "layout": layout, "prefill": str(topology_of(producer_sizes)),
        "decode": str(topology_of(consumer_sizes)), "prompt_tokens": num_tokens, "repeats": len(runs),
        "kv_wait_ms": ms(kv_wait), "first_decode_ms": ms([r["first_decode_s"] for r in runs]),
        "prefill_s": round(statistics.median(r["prefill_s"] for r in runs), 3),
        "steps_to_load": statistics.median(r["steps_to_load"] for r in runs),
        "gc_in_kv_wait_ms": ms([r["gc_in_kv_wait_s"] for r in runs]),
        "all_gc_in_kv_wait_ms": [round(r["gc_in_kv_wait_s"] * 1e3, 3) for r in runs],
        "all_full_gc_in_kv_wait": [r["full_gc_in_kv_wait"] for r in runs],
        "bytes_per_request": posted["bytes"], "latent_bytes": posted["mla_bytes"], "state_bytes": posted["kda_bytes"],
        "gib_per_s": round(posted["bytes"] / statistics.median(kv_wait) / 2**30, 4),
        "descriptors_posted": posted["descriptors"], "mla_descriptors_posted": posted["mla_descriptors"],
        "kda_descriptors_posted": posted["kda_descriptors"], "reads_posted": posted["reads"],
        "descriptors_source": ("measured: the wrapped agent's read (equal to request_ops)" if "split" in runs[-1]
                               else "request_ops over the ranks' registered layouts and the request's LoadSpec"),
        "per_rank": posted["per_rank"],
        "engine_ops_posted": runs[-1]["engine_ops_posted"], "staged_chunks": runs[-1]["staged_chunks"],
        "computed_staged_mla_descriptors": cost.staged_descriptors,
        "computed_staged_descriptors": cost.staged_descriptors + cost.state_descriptors,
        "computed_state_descriptors": cost.state_descriptors,
        # the topology counts a run per producer page; request_ops merges pages contiguous on both sides
        "computed_per_token_mla_descriptors": cost.per_token_descriptors,
        "computed_latent_bytes": cost.latent_bytes, "computed_state_bytes": cost.state_bytes,
        "all_kv_wait_ms": [round(s * 1e3, 3) for s in kv_wait],
        "all_first_decode_ms": [round(r["first_decode_s"] * 1e3, 3) for r in runs],
        "all_prefill_s": [round(r["prefill_s"], 3) for r in runs],
    }
    if "split" in runs[-1]:
        row["kv_wait_split_ms"] = {k.removesuffix("_s"): ms([r["split"][k] for r in runs]) for k in runs[-1]["split"]}
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'backend':9s} {'layout':24s} {'tokens':>6s} {'reps':>4s} {'prefill s':>9s} {'kv_wait ms':>10s} "
            f"{'1st dec ms':>10s} {'MiB':>6s} {'GiB/s':>6s} {'reads':>5s} {'MLA+KDA descr':>13s} "
            f"{'MLA staged*':>11s} {'ops posted':>10s} {'post->done ms':>13s} {'gc ms':>6s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        split = r.get("kv_wait_split_ms")
        descr = f"{r['mla_descriptors_posted']}+{r['kda_descriptors_posted']}"
        print(f"{r['backend']:9s} {r['layout']:24s} {r['prompt_tokens']:6d} {r['repeats']:4d} {r['prefill_s']:9.2f} "
              f"{r['kv_wait_ms']:10.2f} {r['first_decode_ms']:10.2f} {r['bytes_per_request'] / 2**20:6.2f} "
              f"{r['gib_per_s']:6.3f} {r['reads_posted']:5d} {descr:>13s} {r['computed_staged_mla_descriptors']:11d} "
              f"{r['engine_ops_posted']:10d} {split['post_to_done'] if split else float('nan'):13.2f} "
              f"{r['gc_in_kv_wait_ms']:6.2f}")
    print("MLA+KDA descr: the per-token path's descriptors (request_ops); MLA staged*: computed (one per destination "
          "page per MLA layer); ops posted: measured by the consumer engine (staged layouts read through staging "
          "slots); post->done: one-rank consumers only (wrapped agent); gc: this process's "
          "cyclic GC inside kv_wait")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=None, help="comma-separated; default: every installed backend")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated of {', '.join(LAYOUTS)}")
    parser.add_argument("--prompt-lens", default="8192,65536")
    parser.add_argument("--repeats", default="3", help="one count, or one per prompt length (e.g. 3,1)")
    parser.add_argument("--parallel-max-len", type=int, default=None,
                        help="layouts other than tp1_to_tp1 run only prompts of at most this many tokens")
    parser.add_argument("--prefill-budget", type=int, default=4096,
                        help="max_num_batched_tokens (the CPU's MLA prefill materialises chunk x context scores)")
    parser.add_argument("--cache-memory", default="256MiB")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the caches registered as VRAM (NIXL)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="tiny", help="the random preset, its context limit raised")
    parser.add_argument("--ranks-in-processes", action="store_true",
                        help="every engine's ranks as processes (the mp executor), also at TP1: on one GPU, a "
                             "producer and a consumer process as two servers would run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default=None, help="free text written to the result (e.g. what else ran)")
    parser.add_argument("--out", default=None, help="default: results/pd_kv_wait_<date>_cpu.json")
    args = parser.parse_args()
    backends = args.backends.split(",") if args.backends else available_backends()
    layouts = args.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: {name!r} is unknown; choose from {', '.join(LAYOUTS)}")
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    counts = [int(n) for n in args.repeats.split(",")]
    if len(counts) not in (1, len(prompt_lens)):
        raise SystemExit(f"--repeats {args.repeats}: give one count or one per prompt length ({len(prompt_lens)})")
    repeats = dict(zip(prompt_lens, counts * len(prompt_lens) if len(counts) == 1 else counts, strict=True))
    max_len = max(prompt_lens) + 64  # room for the decode leg's tokens
    common = {"model": long_context_tiny(max_len, args.preset), "max_model_len": max_len,
              "enable_prefix_caching": False, "cache_memory": args.cache_memory, "max_num_seqs": 4,
              "max_num_batched_tokens": args.prefill_budget, "seed": args.seed, "device": args.device,
              "dtype": args.dtype}
    if args.ranks_in_processes:
        common["distributed_executor_backend"] = "mp"
    rng = random.Random(args.seed)
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # 1, 5, 15 min: a shared host shows here
    pairs, rows, skipped = {}, [], []
    for backend in backends:
        for layout in layouts:
            lens = prompt_lens
            if layout != "tp1_to_tp1" and args.parallel_max_len is not None:
                lens = [n for n in prompt_lens if n <= args.parallel_max_len]
                skipped += [{"backend": backend, "layout": layout, "prompt_tokens": n,
                             "why": f"--parallel-max-len {args.parallel_max_len}: the producer's prefill on "
                                    "this 2-core CPU takes minutes at this length"}
                            for n in prompt_lens if n > args.parallel_max_len]
            result = bench_pair(backend, layout, lens, repeats, common, rng)
            pairs[f"{backend}/{layout}"] = {k: v for k, v in result.items() if k != "rows"}
            rows += result["rows"]
    date = datetime.date.today().isoformat()
    result = {
        "benchmark": "pd_kv_wait", "date": date, "machine": machine(None), "note": args.note,
        "load_average_at_start": load_at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "versions": {backend: library_version(backend) for backend in backends},
        "setup": ("producer and consumer engines in one process (their ranks as processes under the mp executor), "
                  "KV read over loopback; nixl: UCX, mooncake: TCP. kv_wait: consumer add_request -> the step that "
                  "returns the producer's first token (every rank's load finished); first_decode: -> the step that "
                  "returns the consumer's first sampled token; medians over repeats"),
        "model": {"name": f"{args.preset} preset, context limit raised (agentic.long_context_tiny)",
                  "path": common["model"]},
        "engine_options": {k: v for k, v in common.items() if k != "model"},
        "repeats": {str(n): c for n, c in repeats.items()},
        "repeats_note": ("fewer repeats at the longer prompts: one 65536-token prefill takes minutes on this CPU "
                         "(naive MLA attention)") if len(set(repeats.values())) > 1 else None,
        "skipped": skipped, "pairs": pairs, "rows": rows,
    }
    out = args.out or os.path.join(HERE, "results", f"pd_kv_wait_{date}_{args.device}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    print_table(rows)


if __name__ == "__main__":
    main()
