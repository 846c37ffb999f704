"""The independent-request workloads, random and trace, as streams of `RequestSpec`s, and `Workload`,
what they and the agentic workload share.

A workload's `mode` tells the runner how to send: "queue" (keep `concurrency` requests in flight,
taking the next as one finishes), "timestamps" (send each at its `arrival_s`, at most `concurrency`
in flight) or "sessions" (the agentic workload, `agentic.py`: `concurrency` sessions in flight).
`requests(level)` is lazy and may be endless; the runner takes what its limits allow. Lengths
depend on (seed, level), token ids also on the run's salt (see `tokens`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from deltaserve.bench.mooncake import TraceRecord, read_trace
from deltaserve.bench.serve import tokens
from deltaserve.bench.serve.records import RequestSpec
from deltaserve.bench.serve.trace_mapper import TraceTokenMapper

TRACE_REPLAY_MODES = ("timestamps", "concurrency")


class Workload:
    """What every workload draws with: the served vocabulary, and the run's seed and salt (see `tokens`)."""

    name: str
    mode: str
    size: int | None = None  # requests per level; None: endless

    def __init__(self, vocab_size: int, seed: int, salt: int) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.salt = salt

    def namespace(self, level: int) -> tokens.Namespace:
        """The keys of one concurrency level's draws."""
        return tokens.Namespace(self.seed, self.salt, level)


@dataclass(frozen=True)
class RandomConfig:
    """Random prompts: input and output lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's
    random dataset), after a shared prefix of prefix_len tokens (one per concurrency level)."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"--random-input-len={self.input_len} and --random-output-len={self.output_len} "
                             "must both be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio={self.range_ratio} must be in [0, 1)")
        if self.prefix_len < 0:
            raise ValueError(f"--random-prefix-len={self.prefix_len} must be >= 0")

    def bounds(self, length: int) -> tuple[int, int]:
        """The inclusive range a length is drawn from."""
        return max(1, int(length * (1 - self.range_ratio))), int(length * (1 + self.range_ratio))


class RandomWorkload(Workload):
    """Request i of a level: its lengths keyed by (seed, level, i), its tokens also by the salt."""

    name = "random"
    mode = "queue"

    def __init__(self, config: RandomConfig, vocab_size: int, seed: int, salt: int, max_model_len: int | None,
                 ) -> None:
        super().__init__(vocab_size, seed, salt)
        self.config = config
        longest = config.prefix_len + config.bounds(config.input_len)[1] + config.bounds(config.output_len)[1]
        if max_model_len is not None and longest > max_model_len:
            raise ValueError(
                f"random requests reach {longest} tokens (prefix + input + output at --random-range-ratio="
                f"{config.range_ratio}), more than the server's max_model_len={max_model_len}; shorten --random-"
                "input-len/--random-output-len/--random-prefix-len, or pass a larger --max-model-len to send them"
            )

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.config)}

    def requests(self, level: int) -> Iterator[RequestSpec]:
        """Endless; request i has the same lengths in every run with the same seed."""
        c = self.config
        ns = self.namespace(level)
        prefix = ns.tokens(self.vocab_size, c.prefix_len, tokens.RANDOM_PREFIX)
        in_lo, in_hi = c.bounds(c.input_len)
        out_lo, out_hi = c.bounds(c.output_len)
        for i in itertools.count():
            lengths = ns.length_rng(tokens.RANDOM_PROMPT, i)
            input_len = int(lengths.integers(in_lo, in_hi + 1))
            output_len = int(lengths.integers(out_lo, out_hi + 1))
            yield RequestSpec(prefix + ns.tokens(self.vocab_size, input_len, tokens.RANDOM_PROMPT, i), output_len)


@dataclass(frozen=True)
class TraceConfig:
    """Mooncake trace replay: by timestamp (gaps multiplied by time_scale, so 0.5 is twice as fast) or
    at fixed concurrency; max_output_len caps each record's output_length when set."""

    path: str
    replay: str = "timestamps"
    time_scale: float = 1.0
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.replay not in TRACE_REPLAY_MODES:
            raise ValueError(f"--trace-replay={self.replay!r} must be one of {', '.join(TRACE_REPLAY_MODES)}")
        if self.time_scale < 0:
            raise ValueError(f"--trace-time-scale={self.time_scale} must be >= 0 (0 sends every request at once)")
        if self.max_output_len is not None and self.max_output_len < 1:
            raise ValueError(f"--trace-max-output-len={self.max_output_len} must be at least 1")


class TraceWorkload(Workload):
    """The trace's records in timestamp order, minus those that do not fit the server (counted as skipped)."""

    name = "trace"

    def __init__(self, config: TraceConfig, vocab_size: int, seed: int, salt: int, max_model_len: int | None,
                 records: list[TraceRecord] | None = None) -> None:
        super().__init__(vocab_size, seed, salt)
        self.config = config
        self.mode = "timestamps" if config.replay == "timestamps" else "queue"
        all_records = read_trace(config.path) if records is None else records
        if not all_records:
            raise ValueError(f"--trace {config.path} holds no records")
        self.records = [r for r in all_records
                        if max_model_len is None or r.input_length + self.output_len(r) <= max_model_len]
        self.num_skipped = len(all_records) - len(self.records)
        self.size = len(self.records)
        if not self.records:
            raise ValueError(f"no record of --trace {config.path} fits the server's max_model_len={max_model_len}")

    def output_len(self, record: TraceRecord) -> int:
        """Tokens to generate: the record's output_length (at least 1), capped by max_output_len."""
        n = max(1, record.output_length)
        return n if self.config.max_output_len is None else min(n, self.config.max_output_len)

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.config), "num_records": len(self.records),
                "num_skipped_too_long": self.num_skipped}

    def requests(self, level: int) -> Iterator[RequestSpec]:
        """Each record once, in order; arrival_s counts from the first record's timestamp."""
        mapper = TraceTokenMapper(self.vocab_size, self.namespace(level))
        start = self.records[0].timestamp
        for r in self.records:
            arrival = (r.timestamp - start) / 1000.0 * self.config.time_scale
            yield RequestSpec(mapper.prompt(r), self.output_len(r), arrival_s=arrival)
