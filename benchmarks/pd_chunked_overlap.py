"""Chunked transfer against the per-request path: how much of the KV wait the overlap with the prefill
hides, on CPU loopback.

For each transfer backend, a one-rank producer and a one-rank consumer run in this process (the tiny
preset with its context raised, float32, prefix caching off), once with `chunked_transfer` on the
producer and once without. Per prompt length and repeat the producer gets a fresh prompt of random
token ids (max_tokens=1, do_remote_decode), and the consumer its decode leg (two tokens) once the
producer's params exist: at its finished output on the per-request path, at its first (token-less)
output under chunked transfer. One loop steps both engines in turn, producer first, as two servers
side by side would run them (here they share this process's two cores). Timed with perf_counter:
  prefill_s      producer admission -> its finished output (the prefill leg's answer)
  tail_s         that finished output -> the consumer's output carrying the producer's first token
                 (its load done): the KV wait left after the prefill, what the overlap should shrink
  ttft_s         producer admission -> that consumer output (what a client behind the proxy waits
                 for its first token)
  overlapped_ops descriptors the consumer posted while the producer's prefill still ran
Predicted: the per-request tail grows with the prompt (every latent is read after the prefill); the
chunked tail stays near one chunk's read plus the state, and ttft drops by about the per-request tail.

Usage:
  python benchmarks/pd_chunked_overlap.py --prompt-lens 8192,32768 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time
from typing import Any

from agentic import long_context_tiny
from host_step_time import machine
from pd_kv_wait import settle
from transfer_bandwidth import library_version

from deltaserve import LLM, SamplingParams
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.kv_transfer import available_backends

HERE = os.path.dirname(os.path.abspath(__file__))
CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}


def run_one(producer: LLMEngine, consumer: LLMEngine, request_id: str, ids: list[int]) -> dict[str, Any]:
    """One request through both engines, stepped in turn; its times (seconds) and overlapped ops."""
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    start = time.perf_counter()
    producer.add_request(request_id, {"prompt_token_ids": ids}, prefill)
    prefilled_at = loaded_at = None
    decode_added = False
    overlapped_ops = 0
    counters = consumer.core.kv_transfer
    while loaded_at is None:
        for out in producer.step() if producer.has_unfinished_requests() else []:
            if out.request_id != request_id or out.kv_transfer_params is None:
                continue
            if out.finished:
                prefilled_at = time.perf_counter()
            if not decode_added:  # the early params (chunked), or the finished ones
                decode = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                        extra_args={"kv_transfer_params": out.kv_transfer_params})
                consumer.add_request(request_id, {"prompt_token_ids": ids}, decode)
                decode_added = True
        if not decode_added:
            continue
        before = counters.num_ops
        for out in consumer.step():
            if out.request_id == request_id and out.outputs[0].token_ids:
                loaded_at = time.perf_counter()
        if prefilled_at is None:
            overlapped_ops += counters.num_ops - before
        if not (producer.has_unfinished_requests() or consumer.has_unfinished_requests()) and loaded_at is None:
            raise RuntimeError(f"{request_id}: both engines ran out of work before the consumer's load finished")
    while consumer.has_unfinished_requests() or producer.has_unfinished_requests():
        consumer.step()
        if producer.has_unfinished_requests():
            producer.step()
    settle(producer)
    assert prefilled_at is not None
    return {"prefill_s": prefilled_at - start, "tail_s": loaded_at - prefilled_at, "ttft_s": loaded_at - start,
            "overlapped_ops": overlapped_ops}


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="nixl,mooncake")
    parser.add_argument("--prompt-lens", default="8192,32768")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the producer's prefill chunk")
    parser.add_argument("--out", default=None, help="default: results/pd_chunked_overlap_<date>_cpu.json")
    args = parser.parse_args()
    lens = [int(n) for n in args.prompt_lens.split(",")]
    model = long_context_tiny(max(lens) + 64)
    common = dict(model=model, dtype="float32", device="cpu", enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max(lens) + 64)
    rng = random.Random(0)
    rows = []
    for backend in args.backends.split(","):
        if backend not in available_backends():
            print(f"skipped {backend}: its library is not installed")
            continue
        for chunked in (False, True):
            producer = LLM(**common, kv_transfer_config={"kv_connector": CONNECTORS[backend],
                                                         "kv_role": "kv_producer", "chunked_transfer": chunked})
            consumer = LLM(**common, kv_transfer_config={"kv_connector": CONNECTORS[backend],
                                                         "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"})
            try:
                p, c = producer.llm_engine, consumer.llm_engine
                vocab = p.model_config.vocab_size
                run_one(p, c, "warmup", [rng.randrange(vocab) for _ in range(256)])  # the handshake
                for n in lens:
                    runs = [run_one(p, c, f"{n}-{r}", [rng.randrange(vocab) for _ in range(n)])
                            for r in range(args.repeats)]
                    row = {"backend": backend, "mode": "chunked" if chunked else "per_request", "prompt_tokens": n,
                           "repeats": len(runs), **{f"{k}_ms": ms([r[k] for r in runs])
                                                    for k in ("prefill_s", "tail_s", "ttft_s")},
                           "overlapped_ops": statistics.median(r["overlapped_ops"] for r in runs), "runs": runs}
                    rows.append(row)
                    print(f"{backend:9s} {row['mode']:12s} {n:7d} prefill {row['prefill_s_ms']:9.1f} ms  tail "
                          f"{row['tail_s_ms']:8.1f} ms  ttft {row['ttft_s_ms']:9.1f} ms  overlapped ops "
                          f"{row['overlapped_ops']}", flush=True)
            finally:
                producer.llm_engine.shutdown()
                consumer.llm_engine.shutdown()
    versions = {backend: library_version(backend) for backend in CONNECTORS}  # torch: in machine()
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(HERE, "results", f"pd_chunked_overlap_{date}_cpu.json")
    with open(out, "w") as f:
        json.dump({"date": date, "machine": machine(None), "versions": versions, "args": vars(args), "rows": rows}, f,
                  indent=1)
    print(f"\n{'backend':9s} {'mode':12s} {'tokens':>7s} {'prefill ms':>11s} {'tail ms':>9s} {'ttft ms':>10s}")
    for r in rows:
        print(f"{r['backend']:9s} {r['mode']:12s} {r['prompt_tokens']:7d} {r['prefill_s_ms']:11.1f} "
              f"{r['tail_s_ms']:9.1f} {r['ttft_s_ms']:10.1f}")
    print(f"written: {out}")



if __name__ == "__main__":
    main()
