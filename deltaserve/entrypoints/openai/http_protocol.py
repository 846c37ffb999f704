"""The front end's HTTP/1.1 connection protocol: uvicorn's h11 protocol with two additions.

- A header-read timeout: a connection gets `header_timeout_s` from its first byte (or from the
  connection, or from the end of the previous response) to the end of a request's headers, else it
  is closed. Without it, clients sending headers a byte at a time hold connections open forever.
- Requests h11 cannot parse (a non-numeric Content-Length, a broken request line) are answered with
  OpenAI's JSON error body, as every other error is, instead of uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from deltaserve.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
_MALFORMED = "malformed HTTP request (bad request line, header or Content-Length)"


class HardenedH11Protocol(H11Protocol):
    """`H11Protocol` plus a header-read timeout and JSON 400s; make one with `hardened_h11()`."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._arm_header_timer()  # a new request starts (or goes on): its headers are on the clock
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timeout for the idle connection
        self._cancel_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request headers in %.0f s",
                         self.header_timeout_s)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(OpenAIError(_MALFORMED, 400).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def hardened_h11(header_timeout_s: float) -> type[HardenedH11Protocol]:
    """The protocol class for uvicorn's `http=` with this header-read timeout."""
    return type("HardenedH11Protocol", (HardenedH11Protocol,), {"header_timeout_s": header_timeout_s})
