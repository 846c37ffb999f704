"""A whole run: ask the server what it serves, build the workload, run each concurrency level, and
assemble the results document. Ctrl-C (SIGINT) stops the level in flight; the document then holds
every level measured so far, the partial one included, with `interrupted: true`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import httpx

from deltaserve.bench.serve import metrics, report
from deltaserve.bench.serve.agentic import AgenticWorkload
from deltaserve.bench.serve.client import CompletionClient, ServerInfo
from deltaserve.bench.serve.config import BenchConfig
from deltaserve.bench.serve.runner import Observer, Runner
from deltaserve.bench.serve.workloads import RandomWorkload, TraceWorkload


def build_workload(config: BenchConfig, vocab_size: int, salt: int, max_model_len: int | None) -> Any:
    """The configured workload, checked against the served vocabulary and context limit."""
    if config.workload == "agentic":
        return AgenticWorkload(config.agentic, vocab_size, config.seed, salt, max_model_len)
    if config.workload == "trace":
        assert config.trace is not None  # BenchConfig checks it
        return TraceWorkload(config.trace, vocab_size, config.seed, salt, max_model_len)
    return RandomWorkload(config.random, vocab_size, config.seed, salt, max_model_len)


async def _server_info(client: CompletionClient, config: BenchConfig) -> ServerInfo:
    try:
        return await client.server_info()
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(
            f"--base-url {config.base_url}: GET /v1/models failed ({type(e).__name__}: {e}); is the server up, "
            "and is this its address (and --api-key its key)?"
        ) from None


@contextlib.contextmanager
def _sigint_sets(stop: asyncio.Event) -> Iterator[None]:
    """While inside, the first Ctrl-C sets `stop`; a second one interrupts as usual."""
    loop = asyncio.get_running_loop()

    def first_interrupt() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, first_interrupt)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def run_sweep(config: BenchConfig, observer: Observer | None = None,
                    stop: asyncio.Event | None = None) -> dict:
    """Run every level of `config`; the results document (config, server, environment, levels)."""
    stop = stop or asyncio.Event()
    max_connections = max(config.concurrency) + 8
    async with CompletionClient(
        config.base_url, config.model, endpoint=config.endpoint, api_key=config.api_key,
        request_timeout_s=config.request_timeout_s, temperature=config.temperature,
        return_token_ids=config.return_token_ids, extra_body=config.extra_body, max_connections=max_connections,
    ) as client:
        info = await _server_info(client, config)
        if client.model is None:
            if not info.model_ids:
                raise ValueError(f"--base-url {config.base_url} lists no model in /v1/models; pass --model")
            client.model = info.model_ids[0]
        vocab_size = config.vocab_size or info.vocab_size
        if vocab_size is None:
            raise ValueError("the server does not report its vocabulary size; pass --vocab-size N (prompt token "
                             "ids are drawn from [0, N): for Kimi Linear 163584 keeps clear of its special tokens)")
        max_model_len = config.max_model_len or info.max_model_len
        salt = secrets.randbits(32) if config.salt is None else config.salt
        workload = build_workload(config, vocab_size, salt, max_model_len)
        runner = Runner(client, workload, duration_s=config.duration_s, oracle_block_size=config.oracle_block_size,
                        stop=stop, observer=observer)
        levels: list[dict] = []
        with _sigint_sets(stop):
            for level_index, concurrency in enumerate(config.concurrency):
                run = await runner.run_level(level_index, concurrency, config.num_requests_at(concurrency))
                level = metrics.summarize_level(concurrency, run.records, run.duration_s, config.num_gpus,
                                                config.oracle_block_size, run.counters)
                level["interrupted"] = run.interrupted
                level["workload_stats"] = run.workload_stats
                if config.save_requests:
                    level["requests"] = [report.record_entry(r) for r in run.records]
                levels.append(level)
                if run.interrupted:
                    break
    described = config.describe()
    described.update(model=client.model, vocab_size=vocab_size, max_model_len=max_model_len, salt=salt)
    return {
        "config": described,
        "workload": workload.describe(),
        "server": dataclasses.asdict(info),
        "environment": report.environment(),
        "interrupted": stop.is_set(),
        "levels": levels,
    }
