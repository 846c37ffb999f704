"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure an API front end answers, from a malformed body to an unknown route, goes through
here, so clients see one error shape; a 500 is only ever an engine fault, never bad input.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, format_validation_errors

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """Raised anywhere in a handler to answer with this status and error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_PARAM_AT_START = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[\d+\])?\s*(?:=|:|\b)")


def from_value_error(e: ValueError, default_param: str | None = None) -> OpenAIError:
    """The engine's ValueErrors start with the field they are about ("max_tokens=0 must ...",
    "prompt: 5000 tokens ..."): keep the message, take that field as `param`."""
    message = str(e)
    match = _PARAM_AT_START.match(message)
    param = match.group(1) if match else default_param
    return OpenAIError(message, 400, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_errors(exc.errors())
        return OpenAIError(message, 400, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(status).phrase
        return OpenAIError(message, status).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500, type_="server_error").response()
