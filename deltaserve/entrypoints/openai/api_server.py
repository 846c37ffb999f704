"""One API front-end process: a FastAPI app served by uvicorn, talking to the engine core over ZeroMQ.

Several of these may share one listening socket (`--api-server-count`); each holds its own
tokenizer and detokenizes its own requests. Routes:

    POST /v1/completions, POST /v1/chat/completions   (SSE with "stream": true)
    GET  /v1/models, GET /health, GET|POST /ping, GET /metrics (Prometheus text, from the engine
    core), GET /version; /docs, /redoc and /openapi.json only when no API key is set

With an API key set, every /v1/ route wants `Authorization: Bearer KEY`; /health, /ping, /metrics
and /version stay open for load balancers and scrapers, as in vLLM. Bodies over the size limit get
413 before they are read in full.

Liveness: /health and /ping answer from the engine core's last heartbeat (engine_watch.py), without
a round trip through the engine loop: 200 while the core is alive and finishing steps, 503 once it
has been in one step for longer than `stuck_after_s`, or is gone. When the core or the launcher is
gone, every open stream ends with an error event, new requests get 503, and this process exits.
On SIGTERM it drains: open requests get `shutdown_timeout_s` to finish, then end with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deltaserve import __version__
from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.async_llm import AsyncLLM, EngineDeadError
from deltaserve.engine.engine_watch import DEFAULT_STUCK_AFTER_S, WatchSettings
from deltaserve.engine.processor import ModelInfo
from deltaserve.entrypoints.openai.cpu_work import DEFAULT_TIME_LIMIT_S, CpuWork
from deltaserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from deltaserve.entrypoints.openai.http_protocol import DEFAULT_HEADER_TIMEOUT_S, hardened_h11
from deltaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now_s,
)
from deltaserve.entrypoints.openai.serving_chat import ChatHandler
from deltaserve.entrypoints.openai.serving_common import ServingContext
from deltaserve.entrypoints.openai.serving_completion import CompletionHandler

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
EXIT_ENGINE_GONE = 3  # this front end's exit code when it stopped because the core or launcher was gone
_EXIT_GRACE_S = 0.5  # after the core is gone: time for the error events to reach the clients


@dataclass
class FrontendSettings:
    """Everything one front-end process needs (it pickles: the launcher hands it to each process)."""

    engine_config: EngineConfig
    engine_address: str
    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    max_model_len: int | None = None  # as the core resolved it
    kv_capacity_tokens: int | None = None  # tokens of context the core's KV cache holds
    heartbeat_address: str | None = None  # the core's heartbeat; None: no liveness watch (tests)
    launcher_pid: int | None = None
    stuck_after_s: float = DEFAULT_STUCK_AFTER_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    trust_request_chat_template: bool = False
    cpu_work_timeout_s: float = DEFAULT_TIME_LIMIT_S  # tokenizing or rendering one prompt


class BodyLimitMiddleware:
    """Answer 413 to bodies over `max_bytes`: at once from Content-Length, else while reading."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = OpenAIError(f"request body exceeds the limit of {self.max_bytes} bytes", 413)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await OpenAIError("Content-Length is not a number", 400).response()(scope, receive, send)
                    return
                if length > self.max_bytes:
                    await too_big.response()(scope, receive, send)
                    return
        received = 0
        over_limit = False
        replaced = False

        async def limited_receive() -> dict:
            nonlocal received, over_limit
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over_limit = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def limited_send(message: dict) -> None:
            # a chunked body went over the limit: whatever the app answers (it saw a cut body), send 413
            nonlocal replaced
            if not over_limit:
                await send(message)
            elif not replaced:
                replaced = True
                await too_big.response()(scope, receive, send)

        await self.app(scope, limited_receive, limited_send)


def _key_matches(header: str, api_key: str) -> bool:
    """Whether `Authorization: Bearer <token>` carries the key; compared as bytes, in constant time
    (headers arrive as latin-1 text, so any byte a client sends compares without an error)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode("utf-8"))


def build_app(settings: FrontendSettings, info: ModelInfo | None = None) -> FastAPI:
    """The FastAPI app of one front end. The engine client is made on startup, inside the event loop.

    `app.state.on_engine_gone(reason)` is called once the core (or the launcher) is gone; the
    process entry point sets it to stop the server.
    """
    info = info or ModelInfo.load(settings.engine_config)
    if settings.max_model_len is not None:
        info.max_model_len = settings.max_model_len
    state: dict[str, Any] = {}
    docs = {} if not settings.api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        watch = None
        if settings.heartbeat_address is not None:
            watch = WatchSettings(settings.heartbeat_address, settings.launcher_pid, settings.stuck_after_s)
        engine = AsyncLLM(settings.engine_address, info, settings.engine_config.max_logprobs, watch,
                          on_dead=lambda reason: app.state.on_engine_gone(reason))
        engine.start()
        cpu_work = CpuWork(time_limit_s=settings.cpu_work_timeout_s)
        ctx = ServingContext(engine, settings.served_model_names, settings.engine_config.max_logprobs, cpu_work,
                             settings.trust_request_chat_template)
        state.update(engine=engine, completions=CompletionHandler(ctx), chat=ChatHandler(ctx))
        try:
            yield
        finally:
            await engine.close()
            cpu_work.shutdown()

    app = FastAPI(title="deltaserve OpenAI-compatible API", version=__version__, lifespan=lifespan, **docs)
    app.state.on_engine_gone = lambda reason: None
    install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key_and_engine(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if settings.api_key and not _key_matches(header, settings.api_key):
                message = "Incorrect API key provided." if header else "Missing API key: send Authorization: Bearer"
                return OpenAIError(message, 401, code="invalid_api_key").response()
            dead = state["engine"].dead if "engine" in state else None
            if dead is not None:
                return OpenAIError(f"the engine is not available: {dead}", 503).response()
        return await call_next(request)

    def health_response() -> Response:
        problem = state["engine"].problem()
        if problem is not None:
            return OpenAIError(problem, 503).response()
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return health_response()

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return health_response()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await state["engine"].call("metrics_text")
        except EngineDeadError as e:
            return OpenAIError(str(e), 503).response()
        return Response(content=text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        created = now_s()
        return ModelList(data=[
            ModelCard(id=name, created=created, root=info.model_dir, max_model_len=info.max_model_len,
                      vocab_size=info.model_config.vocab_size, kv_cache_capacity_tokens=settings.kv_capacity_tokens)
            for name in settings.served_model_names
        ])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        return await state["completions"](body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await state["chat"](body, raw_request)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.state.engine = lambda: state.get("engine")
    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, which also tells `on_exit_signal` (in the loop's thread) of SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, on_exit_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit_signal = on_exit_signal
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_exit_signal)


class FrontendServer:
    """One front end's app on uvicorn: at the end of the drain open requests end with an error event
    (not a cut connection), and the server stops by itself once the engine core is gone."""

    def __init__(self, app: FastAPI, settings: FrontendSettings) -> None:
        config = uvicorn.Config(
            app, log_level=settings.log_level.lower(), access_log=False, http=hardened_h11(settings.header_timeout_s),
            # uvicorn's own limit is a backstop: by then every open request has ended with an error event
            timeout_graceful_shutdown=settings.shutdown_timeout_s + 5.0,
        )
        self.app = app
        self.shutdown_timeout_s = settings.shutdown_timeout_s
        self.uvicorn = _DrainingServer(config, self._on_exit_signal)
        self.gone_reason: str | None = None
        self._draining = False
        app.state.on_engine_gone = self._on_engine_gone

    def _on_exit_signal(self) -> None:
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self._cut_open_requests)

    def _cut_open_requests(self) -> None:
        engine = self.app.state.engine()
        if engine is not None:
            engine.fail_all(f"the server is shutting down: the request did not finish within the "
                            f"{self.shutdown_timeout_s:g} s shutdown timeout")

    def _on_engine_gone(self, reason: str) -> None:
        self.gone_reason = reason
        asyncio.get_running_loop().call_later(_EXIT_GRACE_S, setattr, self.uvicorn, "should_exit", True)

    def run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self.uvicorn.serve(sockets=[sock]))
        except KeyboardInterrupt:
            # uvicorn handles SIGINT (drains, shuts down), then raises it again for the previous handler:
            # asyncio's, which cancels the main task if it has not ended yet. The shutdown is done by then.
            pass


def run_api_server(settings: FrontendSettings, sock: socket.socket) -> None:
    """Process entry point: serve the app on an already-bound socket until SIGTERM/SIGINT, then drain
    for up to `shutdown_timeout_s`. Exits with EXIT_ENGINE_GONE when it stopped because the engine
    core or the launcher was gone."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = FrontendServer(build_app(settings), settings)
    server.run(sock)
    if server.gone_reason is not None:
        sys.exit(EXIT_ENGINE_GONE)
