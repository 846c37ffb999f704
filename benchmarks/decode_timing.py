"""Timing pure decode steps of an engine: shared by the executor-overhead and DCP benchmarks."""

from __future__ import annotations

import time

import torch

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.sampling_params import SamplingParams


def time_decode_steps(engine: LLMEngine, batch: int, context: int, steps: int, warmup: int) -> list[float]:
    """Add `batch` greedy requests of a random `context`-token prompt, step until every one has its
    first token (prefill done), then return the wall ms of each of `steps` engine-core decode steps
    after `warmup` untimed ones."""
    core = engine.core
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 32, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < batch:
        outputs, _ = core.step()
        started.update(o.request_id for o in outputs if o.new_token_ids)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        core.step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times
