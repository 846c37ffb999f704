"""The settings of one `deltaserve bench serve` run, checked when they are made (errors name the flag)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.bench.serve.agentic import AgenticConfig
from deltaserve.bench.serve.workloads import RandomConfig, TraceConfig

WORKLOADS = ("agentic", "trace", "random")
REQUESTS_PER_SLOT = 10  # with neither --num-requests nor --duration, a level sends 10 x its concurrency


@dataclass
class BenchConfig:
    """Everything a run needs. num_requests and duration_s are per concurrency level; with neither, a
    level sends REQUESTS_PER_SLOT x its concurrency requests. vocab_size and max_model_len default
    to what the server reports (/v1/models); max_model_len only gates what the client sends. seed fixes
    every length; token ids also depend on salt (None: a fresh one per run, see `tokens`)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    workload: str = "random"
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_requests: int | None = None
    duration_s: float | None = None
    num_gpus: int = 1
    seed: int = 0
    salt: int | None = None
    out: str | None = None
    plot_dir: str | None = None
    save_requests: bool = False
    vocab_size: int | None = None
    max_model_len: int | None = None
    request_timeout_s: float = 3600.0
    temperature: float = 0.0
    return_token_ids: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    oracle_block_size: int = 16
    progress: bool = True
    random: RandomConfig = field(default_factory=RandomConfig)
    trace: TraceConfig | None = None
    agentic: AgenticConfig = field(default_factory=AgenticConfig)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload={self.workload!r} must be one of {', '.join(WORKLOADS)}")
        if self.workload == "trace" and self.trace is None:
            raise ValueError("--workload trace needs --trace FILE (a Mooncake trace, one JSON object a line)")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency={self.concurrency} must be a list of positive integers, e.g. 1,8,32")
        checks = (("--num-requests", self.num_requests, 1), ("--seed", self.seed, 0), ("--salt", self.salt, 0),
                  ("--num-gpus", self.num_gpus, 1),
                  ("--vocab-size", self.vocab_size, 2), ("--max-model-len", self.max_model_len, 2),
                  ("--oracle-block-size", self.oracle_block_size, 1))
        for flag, value, least in checks:
            if value is not None and value < least:
                raise ValueError(f"{flag}={value} must be at least {least}")
        for flag, value in (("--duration", self.duration_s), ("--request-timeout", self.request_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag}={value} must be positive (seconds)")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"--temperature={self.temperature} must be in [0, 2]")

    def num_requests_at(self, concurrency: int) -> int | None:
        """The request limit of the level at `concurrency` (None: the duration alone ends it)."""
        if self.num_requests is not None or self.duration_s is not None:
            return self.num_requests
        return REQUESTS_PER_SLOT * concurrency

    def describe(self) -> dict[str, Any]:
        """The run's settings for the JSON (the API key left out)."""
        return {
            "base_url": self.base_url, "endpoint": self.endpoint, "model": self.model, "workload": self.workload,
            "concurrency": list(self.concurrency), "num_requests": self.num_requests,
            "requests_per_level": [self.num_requests_at(c) for c in self.concurrency],
            "duration_s": self.duration_s, "num_gpus": self.num_gpus, "seed": self.seed,
            "vocab_size": self.vocab_size, "max_model_len": self.max_model_len, "temperature": self.temperature,
            "ignore_eos": True, "return_token_ids": self.return_token_ids, "extra_body": self.extra_body,
            "request_timeout_s": self.request_timeout_s, "oracle_block_size": self.oracle_block_size,
        }
