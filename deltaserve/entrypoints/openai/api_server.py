"""One API front-end process: a FastAPI app served by uvicorn, talking to the engine core over ZeroMQ.

Several of these may share one listening socket (`--api-server-count`); each holds its own
tokenizer and detokenizes its own requests. Routes:

    POST /v1/completions, POST /v1/chat/completions   (SSE with "stream": true)
    GET  /v1/models, GET /health, GET /metrics (Prometheus text, from the engine core), GET /version

With an API key set, every /v1/ route wants `Authorization: Bearer KEY`. Bodies over the size limit
get 413 before they are read in full.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deltaserve import __version__
from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.async_llm import AsyncLLM, EngineDeadError
from deltaserve.engine.processor import ModelInfo
from deltaserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
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


def build_app(settings: FrontendSettings, info: ModelInfo | None = None) -> FastAPI:
    """The FastAPI app of one front end. The engine client is made on startup, inside the event loop."""
    info = info or ModelInfo.load(settings.engine_config)
    if settings.max_model_len is not None:
        info.max_model_len = settings.max_model_len
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine = AsyncLLM(settings.engine_address, info, settings.engine_config.max_logprobs)
        engine.start()
        ctx = ServingContext(engine, settings.served_model_names, settings.engine_config.max_logprobs)
        state.update(engine=engine, completions=CompletionHandler(ctx), chat=ChatHandler(ctx))
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="deltaserve OpenAI-compatible API", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), settings.api_key):
                message = "Incorrect API key provided." if header else "Missing API key: send Authorization: Bearer"
                return OpenAIError(message, 401, code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        try:
            await state["engine"].call("ping", timeout_s=5.0)
        except EngineDeadError as e:
            return OpenAIError(str(e), 503).response()
        return Response(status_code=200)

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
                      vocab_size=info.model_config.vocab_size)
            for name in settings.served_model_names
        ])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        return await state["completions"](body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await state["chat"](body, raw_request)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app


def run_api_server(settings: FrontendSettings, sock: socket.socket) -> None:
    """Process entry point: serve the app on an already-bound socket until SIGTERM/SIGINT, then drain
    for up to `shutdown_timeout_s` (open streams finish or are cancelled, which aborts them)."""
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(settings)
    config = uvicorn.Config(
        app, log_level=settings.log_level.lower(), access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) or None,
    )
    uvicorn.Server(config).run(sockets=[sock])
