"""The proxy's FastAPI app: POST /v1/completions and /v1/chat/completions through both legs (relay.py),
GET /v1/models from the first decode server, GET /health (200 while the proxy runs; the body says
which backends answer their /health) and GET /metrics (Prometheus text).

With `--api-key`, every /v1/ route wants `Authorization: Bearer KEY`; /health and /metrics stay open.
A non-streaming request whose client leaves is cancelled, which closes its leg's connection (and the
backend aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from deltaserve import __version__
from deltaserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from deltaserve.entrypoints.proxy.config import ProxyOptions
from deltaserve.entrypoints.proxy.legs import CHAT, COMPLETIONS, leg_failed, leg_unreachable
from deltaserve.entrypoints.proxy.metrics import ProxyMetrics
from deltaserve.entrypoints.proxy.relay import Relay

T = TypeVar("T")
_PROBE_TIMEOUT_S = 2.0


def _key_matches(header: str, api_key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                              api_key.encode("utf-8"))


async def _unless_client_leaves(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """`work()`, cancelled if the client disconnects first (then a 499 no one reads)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise OpenAIError("client disconnected", 499)
    return task.result()


def build_proxy_app(options: ProxyOptions) -> FastAPI:
    """The proxy's app; its pooled HTTP client is made on startup, inside the serving event loop."""
    options.validate()
    metrics = ProxyMetrics()
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(options.timeout_s, connect=options.connect_timeout_s)
        limits = httpx.Limits(max_connections=options.max_connections,
                              max_keepalive_connections=options.max_connections)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["client"] = client
            state["relay"] = app.state.relay = Relay(options, client, metrics)
            yield

    docs = {} if not options.api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="deltaserve P/D proxy", version=__version__, lifespan=lifespan, **docs)
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if options.api_key and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if not _key_matches(header, options.api_key):
                message = "Incorrect API key provided." if header else "Missing API key: send Authorization: Bearer"
                return OpenAIError(message, 401, code="invalid_api_key").response()
        return await call_next(request)

    async def relay(endpoint: str, request: Request) -> Response:
        try:
            raw_body = await request.body()  # read before watching for a disconnect on the same channel
        except ClientDisconnect:  # the client left before its body arrived: nothing was sent anywhere
            metrics.requests.labels(endpoint=endpoint, outcome="cancelled").inc()
            return Response(status_code=499)
        return await _unless_client_leaves(request, lambda: state["relay"](endpoint, request, raw_body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(COMPLETIONS, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay(CHAT, request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = options.decode_urls[0]
        headers = state["relay"].backend_headers(request)
        try:
            response = await state["client"].get(url + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            raise leg_unreachable("decode", url, e) from e
        if response.status_code >= 400:
            raise leg_failed("decode", url, response)
        return Response(response.content, status_code=200, media_type="application/json")

    async def probe(role: str, url: str) -> dict[str, Any]:
        try:
            response = await state["client"].get(url + "/health", timeout=_PROBE_TIMEOUT_S)
            status: int | None = response.status_code
        except httpx.HTTPError:
            status = None
        return {"role": role, "url": url, "reachable": status is not None, "healthy": status == 200,
                "status_code": status}

    @app.get("/health")
    async def health() -> JSONResponse:
        probes = [("prefill", url) for url in options.prefill_urls] + [("decode", url) for url in options.decode_urls]
        backends = await asyncio.gather(*(probe(role, url) for role, url in probes))
        return JSONResponse({"status": "ok", "backends": list(backends)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
