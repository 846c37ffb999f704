"""The streaming client: one OpenAI /v1/completions request -> one `RequestRecord` of timestamps.

Every request streams with `ignore_eos` and `max_tokens` set to the exact output length, asks for
`stream_options.include_usage` (token counts and `prompt_tokens_details.cached_tokens`) and, unless
turned off, vLLM's `return_token_ids` (the generated ids, which the agentic workload appends to the
context). Prompts go as token ids, so their lengths are exact. A failure of any kind (an HTTP
status, an error event in the stream, a connection error, a timeout, a body that is not the API's)
is written into the record's `error`; nothing here raises except cancellation.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from deltaserve.bench.serve.records import RequestRecord, RequestSpec, Usage

_ERROR_CHARS = 300  # of a server's error message kept in the record

# (queries, hits) counters of the prefix cache in /metrics, by server
PREFIX_CACHE_COUNTERS = (
    ("deltaserve:prefix_cache_queries_total", "deltaserve:prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)
OFFLOAD_HIT_TOKENS = "deltaserve:offload_hit_tokens_total"  # the offload tier's share of the hits
OFFLOAD_TIER_HITS = "deltaserve:offload_tier_hits_total"  # objects loaded, by tier label


@dataclass
class ServerInfo:
    """What the server says about itself: /v1/models (max_model_len as vLLM and deltaserve report
    it; vocab_size is deltaserve's own) and /version."""

    model_ids: list[str]
    max_model_len: int | None
    vocab_size: int | None
    version: str | None


@dataclass
class PrefixCacheCounters:
    """Prompt tokens the server looked up in its prefix cache and found, from /metrics, so far."""

    queries: float
    hits: float
    metric: str  # the queries counter's name
    # deltaserve's offload tier: the hit tokens it added beyond HBM, and objects loaded per tier
    tier_hits: float | None = None
    tier_object_hits: dict[str, float] | None = None


def root_url(base_url: str) -> str:
    """The server's root: "http://host:8000/v1/" and "http://host:8000" both give "http://host:8000"."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _error_message(status: int, body: bytes) -> str:
    """'HTTP 400: <message>' from OpenAI's error body, or from the first characters of any other body."""
    text = body.decode("utf-8", "replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.strip()
    return f"HTTP {status}: {str(message)[:_ERROR_CHARS]}"


def parse_prefix_cache_counters(text: str) -> PrefixCacheCounters | None:
    """The first pair of PREFIX_CACHE_COUNTERS present in a Prometheus exposition, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_tier: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name == OFFLOAD_TIER_HITS and "tier" in sample.labels:
                tier = sample.labels["tier"]
                per_tier[tier] = per_tier.get(tier, 0.0) + sample.value
    for queries, hits in PREFIX_CACHE_COUNTERS:
        if queries in totals and hits in totals:
            return PrefixCacheCounters(totals[queries], totals[hits], queries, totals.get(OFFLOAD_HIT_TOKENS),
                                       per_tier or None)
    return None


class CompletionClient:
    """An async HTTP client for one server and model; use as `async with CompletionClient(...) as c`."""

    def __init__(self, base_url: str, model: str | None = None, *, endpoint: str = "/v1/completions",
                 api_key: str | None = None, request_timeout_s: float = 3600.0, temperature: float = 0.0,
                 return_token_ids: bool = True, extra_body: dict[str, Any] | None = None,
                 max_connections: int = 1024) -> None:
        self.root = root_url(base_url)
        self.model = model
        self.endpoint = endpoint
        self.temperature = temperature
        self.return_token_ids = return_token_ids
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.root, headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=min(request_timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def server_info(self) -> ServerInfo:
        """GET /v1/models (and /version where there is one). Raises httpx.HTTPError when the server
        cannot be reached or /v1/models fails: then there is nothing to benchmark."""
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        cards = response.json().get("data") or []
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else {})
        version = None
        try:
            reply = await self._http.get("/version")
            if reply.status_code == 200:
                version = reply.json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        return ServerInfo([c.get("id") for c in cards], card.get("max_model_len"), card.get("vocab_size"), version)

    async def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        """The prefix-cache counters in /metrics, or None where the server exports none we know."""
        try:
            response = await self._http.get("/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            return parse_prefix_cache_counters(response.text)
        except ValueError:
            return None

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        """The request body for `spec`; extra_body entries are added last and win."""
        body: dict[str, Any] = {
            "model": self.model, "prompt": spec.prompt_token_ids, "max_tokens": spec.max_tokens,
            "temperature": self.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.return_token_ids:
            body["return_token_ids"] = True
        if spec.cache_control:
            body["cache_control"] = {"type": "ephemeral"}
        body.update(self.extra_body)
        return body

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Send `spec` and fill `record` in place as the stream arrives. Cancellation marks the
        record cancelled and propagates; every other failure ends in `record.error`."""
        body = json.dumps(self.payload(spec)).encode()
        record.send_time = time.perf_counter()
        try:
            async with self._http.stream("POST", self.endpoint, content=body,
                                         headers={"Content-Type": "application/json"}) as response:
                if response.status_code != 200:
                    record.error = _error_message(response.status_code, await response.aread())
                    return
                await self._read_stream(response, record)
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        except httpx.TimeoutException as e:
            record.error = f"timeout ({type(e).__name__})"
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {str(e)[:_ERROR_CHARS]}"
        finally:
            record.end_time = time.perf_counter()

    @staticmethod
    async def _read_stream(response: httpx.Response, record: RequestRecord) -> None:
        """Server-sent events until [DONE]: a token chunk's arrival time, its ids, the usage."""
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            now = time.perf_counter()
            try:
                event = json.loads(data)
                if event.get("error") is not None:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    record.error = f"error in stream: {str(message)[:_ERROR_CHARS]}"
                    return
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids")
                    if choice.get("text") or ids:
                        record.chunk_times.append(now)
                    if ids:
                        if record.output_token_ids is None:
                            record.output_token_ids = []
                        record.output_token_ids.extend(ids)
                usage = event.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    record.usage = Usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]),
                                         details.get("cached_tokens"))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                record.error = f"bad stream event ({type(e).__name__}): {data[:_ERROR_CHARS]}"
                return
        record.error = "the stream ended before [DONE]"
