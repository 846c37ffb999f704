"""One P/D request through its two legs: pick the backends, send the prefill leg, then the decode leg,
streamed through as server-sent events when the client asked for a stream, else as JSON.

The prefill leg is read as a stream. From a chunked-transfer producer its first event carries the
params, and the decode leg starts then, while the prefill runs; the rest of the prefill leg is read
in the background (closing it would abort the prefill), and a prefill that fails after that reaches
the client through the decode leg, whose load fails."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deltaserve.entrypoints.openai.errors import OpenAIError
from deltaserve.entrypoints.proxy.config import ProxyOptions
from deltaserve.entrypoints.proxy.legs import (
    ENDPOINT_PATHS,
    PrefillAnswer,
    check_body,
    decode_body,
    leg_failed,
    leg_unreachable,
    prefill_body,
)
from deltaserve.entrypoints.proxy.metrics import ProxyMetrics
from deltaserve.entrypoints.proxy.policies import Backend, BackendPool


class RelayedStream(StreamingResponse):
    """A streamed decode leg; `on_close` runs once the response ends, however it ends (finished, the
    client gone, or never started), so the upstream stream is closed and the leg is counted out."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class Relay:
    """The proxy's request path; one per app, sharing one pooled `httpx.AsyncClient`."""

    def __init__(self, options: ProxyOptions, client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
        self.options = options
        self.client = client
        self.metrics = metrics
        self.prefill = BackendPool("prefill", options.prefill_urls, options.policy, metrics.backend_changed)
        self.decode = BackendPool("decode", options.decode_urls, options.policy, metrics.backend_changed)
        self._draining: set[asyncio.Task] = set()  # prefill legs read on after their decode leg started

    def backend_headers(self, request: Request) -> dict[str, str]:
        """The backends get `--backend-api-key` when one is set, else the client's Authorization header."""
        headers = {"X-Request-Id": request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"}
        if self.options.backend_api_key:
            headers["Authorization"] = f"Bearer {self.options.backend_api_key}"
        elif "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        return headers

    async def __call__(self, endpoint: str, request: Request, raw_body: bytes) -> Response:
        """Both legs of one request; an OpenAIError (a leg's, or the proxy's own 400) is the answer."""
        outcome = "bad_request"
        try:
            try:
                body = check_body(endpoint, json.loads(raw_body))
            except ValueError as e:
                raise OpenAIError(f"The request body is not valid JSON: {e}", 400) from e
            headers = self.backend_headers(request)
            outcome = "prefill_error"
            prefill, prefill_url = await self._prefill(endpoint, body, headers)
            outcome = "decode_error"
            leg = decode_body(endpoint, body, prefill, prefill_url)
            if body.get("stream") is True:
                response = await self._decode_stream(endpoint, leg, headers)
                outcome = "streaming"  # counted when the stream ends
                return response
            response = await self._decode(endpoint, leg, headers)
            outcome = "ok"
            return response
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client left
            raise
        finally:
            if outcome != "streaming":
                self.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    async def _send(self, leg: str, backend: Backend, path: str, body: dict[str, Any],
                    headers: dict[str, str], stream: bool = False) -> httpx.Response:
        request = self.client.build_request("POST", backend.url + path, json=body, headers=headers)
        try:
            return await self.client.send(request, stream=stream)
        except httpx.HTTPError as e:
            raise leg_unreachable(leg, backend.url, e) from e

    async def _prefill(self, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                       ) -> tuple[dict[str, Any], str]:
        started = time.monotonic()
        backend = self.prefill.acquire()
        response: httpx.Response | None = None

        async def finish() -> None:
            if response is not None:
                await response.aclose()
            self.prefill.release(backend)
            self.metrics.leg_seconds.labels(leg="prefill").observe(time.monotonic() - started)

        try:
            response = await self._send("prefill", backend, ENDPOINT_PATHS[endpoint], prefill_body(endpoint, body),
                                        headers, stream=True)
            if response.status_code >= 400:
                await response.aread()
                raise leg_failed("prefill", backend.url, response)
            answer = PrefillAnswer(backend.url)
            events = _events(response)
            try:
                async for event in events:
                    answer.add(event)
                    if answer.early:
                        break
            except httpx.HTTPError as e:
                raise leg_unreachable("prefill", backend.url, e) from e
        except BaseException:
            await finish()
            raise
        if answer.early:  # chunked transfer: the decode leg starts now; the prefill leg is read to its end
            task = asyncio.ensure_future(self._drain(events, finish))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        else:
            await finish()
        return answer.as_response(), backend.url

    @staticmethod
    async def _drain(events: AsyncIterator[Any], finish: Callable[[], Awaitable[None]]) -> None:
        try:
            async for _ in events:
                pass
        except httpx.HTTPError:
            pass  # the prefill server went away: the decode leg's load fails and says so
        finally:
            await finish()

    async def _decode(self, endpoint: str, leg: dict[str, Any], headers: dict[str, str]) -> Response:
        started = time.monotonic()
        with self.decode.lease() as backend:
            try:
                response = await self._send("decode", backend, ENDPOINT_PATHS[endpoint], leg, headers)
            finally:
                self.metrics.leg_seconds.labels(leg="decode").observe(time.monotonic() - started)
        if response.status_code >= 400:
            raise leg_failed("decode", backend.url, response)
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))

    async def _decode_stream(self, endpoint: str, leg: dict[str, Any], headers: dict[str, str]) -> Response:
        """Open the decode leg's stream; its error answer (before any event) is an error, not a stream."""
        started = time.monotonic()
        backend = self.decode.acquire()
        try:
            response = await self._send("decode", backend, ENDPOINT_PATHS[endpoint], leg, headers, stream=True)
            if response.status_code >= 400:
                await response.aread()
                await response.aclose()
                raise leg_failed("decode", backend.url, response)
        except BaseException:
            self.decode.release(backend)
            self.metrics.leg_seconds.labels(leg="decode").observe(time.monotonic() - started)
            raise
        outcome = ["ok"]

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_bytes():
                    yield chunk
            except httpx.HTTPError as e:  # the decode server went away mid-stream: say so, then end
                outcome[0] = "decode_error"
                error = leg_unreachable("decode", backend.url, e)
                yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()

        async def on_close() -> None:
            await response.aclose()
            self.decode.release(backend)
            self.metrics.leg_seconds.labels(leg="decode").observe(time.monotonic() - started)
            self.metrics.requests.labels(endpoint=endpoint, outcome=outcome[0]).inc()

        return RelayedStream(events(), on_close)


async def _events(response: httpx.Response) -> AsyncIterator[Any]:
    """The JSON of each server-sent event of `response`, up to "[DONE]"."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                yield json.loads(line[len("data: "):])
            except ValueError as e:
                raise OpenAIError(f"prefill leg: an event is not JSON: {line[:200]!r}", 502,
                                  code="prefill_bad_response", type_="server_error") from e
