"""Plain data of the benchmark: what one request asks for, and what happened to it.

Times are seconds on one monotonic clock (`time.perf_counter()`), so only their differences mean
anything. A chunk counts as a token chunk when it carries text or token ids (the usage chunk at the
end carries neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestSpec:
    """One request to send: the exact prompt token ids and the exact number of tokens to generate.

    arrival_s: for trace replay by timestamp, when to send it, in seconds after the level starts
    (already scaled). session_id/turn: for the agentic workload, which session and turn it is;
    cache_control: whether the request asks the server's offload tier to keep its prefix.
    """

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float | None = None
    session_id: int | None = None
    turn: int | None = None
    cache_control: bool = False  # send cache_control: {"type": "ephemeral"} (the offload tier's hint)


@dataclass
class Usage:
    """The server's `usage` of one request; cached_tokens is None when it sends no prompt_tokens_details."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


@dataclass
class RequestRecord:
    """What happened to one request.

    send_time: just before the request was written; chunk_times: the arrival of each token chunk;
    end_time: when the stream ended ([DONE] or the connection closed). error: None when it succeeded,
    else what went wrong (an HTTP status and the server's message, a connection error, a timeout).
    cancelled: the run was stopped (Ctrl-C) while it was in flight; it is neither completed nor failed.
    output_token_ids: the generated ids when the server returns them (`return_token_ids`), else None.
    block_keys: keys of the full blocks of prompt + output, for the oracle (`prefix_oracle.block_keys`).
    """

    index: int
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    output_token_ids: list[int] | None = None
    usage: Usage | None = None
    error: str | None = None
    cancelled: bool = False
    session_id: int | None = None
    turn: int | None = None
    block_keys: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Finished, without an error and without being cancelled."""
        return self.error is None and not self.cancelled and self.end_time is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first token chunk."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from send to the last token chunk (to the end of the stream if none came)."""
        if self.chunk_times:
            return self.chunk_times[-1] - self.send_time
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token chunks, one per chunk after the first (a chunk may hold several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def output_tokens(self) -> tuple[int, str]:
        """(generated tokens, where the count comes from): the server's usage, else the token ids it
        streamed, else one per token chunk."""
        if self.usage is not None:
            return self.usage.completion_tokens, "usage"
        if self.output_token_ids is not None:
            return len(self.output_token_ids), "token_ids"
        return len(self.chunk_times), "chunks"

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1), for requests with at least two output tokens."""
        n, _ = self.output_tokens
        ttft, e2e = self.ttft, self.e2e_latency
        if n < 2 or ttft is None or e2e is None:
            return None
        return (e2e - ttft) / (n - 1)
