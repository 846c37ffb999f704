"""The side channel between a P/D producer and its consumers: ZeroMQ, JSON messages.

The producer's engine core binds one ROUTER socket (kv_ip:kv_port) served by a thread. A consumer
rank asks it for the producer's cache layouts (`handshake`: every producer rank's `RankLayout`,
keyed by (pp_rank, tp_rank)), and, once its reads of a request are done, says so (`release`,
naming the request, itself and how many consumer ranks read that request). A request is released
when all its readers have said so; the producer's scheduler side then frees its blocks and slot. The
answer to a release says whether the request was still held: a request the producer freed after its
transfer_timeout_s may have had its blocks reused while the consumer read them, so a consumer rank
trusts a finished read only when the producer still held the request when the read was released.
Under chunked transfer a consumer rank also asks for a request's `progress` while its prefill runs
(the scheduler side's `streams` entry: tokens computed and their blocks, final params, or why not).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any

import zmq

from deltaserve.kv_transfer.layout import RankLayout

logger = logging.getLogger(__name__)

POLL_MS = 100
REQUEST_TIMEOUT_MS = 10_000


class JsonServer:
    """A ZeroMQ ROUTER on host:port (0: a free one) served by a daemon thread: each request is one
    JSON message answered by `_answer` (JSON bytes); a malformed one gets {"error": ...}. The producer's
    side channel and each producer rank's staging server (kv_transfer/staging.py) are ones."""

    def __init__(self, host: str, port: int, what: str) -> None:
        self.what = what  # names its thread and its error answers
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-{what}", daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                reply = self._answer(json.loads(frames[-1]))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                reply = json.dumps({"error": f"bad {self.what} message: {e!r}"}).encode()
            self._socket.send_multipart([identity, b"", reply])
        self._socket.close(0)
        self._context.term()

    def _answer(self, message: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class ProducerSideChannel(JsonServer):
    """Answers handshakes with `layouts` and collects releases; `drain_released()` takes them."""

    def __init__(self, host: str, port: int, engine_id: str, layouts: list[RankLayout],
                 streams: dict[str, dict[str, Any]] | None = None, held: dict[str, float] | None = None) -> None:
        super().__init__(host, port, "side-channel")
        self.engine_id = engine_id
        self.streams = streams if streams is not None else {}  # the scheduler side's, read here
        self.held = held  # the scheduler side's held requests (request id -> deadline), read here
        self._handshake = json.dumps({"engine_id": engine_id,
                                      "layouts": [layout.to_json() for layout in layouts]}).encode()
        self._readers: dict[str, set[str]] = {}
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread.start()

    def _answer(self, message: dict[str, Any]) -> bytes:
        kind = message["kind"]
        if kind == "handshake":
            return self._handshake
        if kind == "release":
            request_id, reader, readers = str(message["request_id"]), str(message["reader"]), int(message["readers"])
            done = self._readers.setdefault(request_id, set())
            done.add(reader)
            # held until this reader's release: its blocks were intact for the whole read (freed only
            # by the last release or by the timeout, which removes the entry first)
            held = self.held is None or request_id in self.held
            if len(done) >= readers:
                del self._readers[request_id]
                self._released.put(request_id)
            return json.dumps({"ok": True, "held": held}).encode()
        if kind == "progress":
            progress = self.streams.get(str(message["request_id"]))
            if progress is None:
                progress = {"state": "gone", "why": "the producer holds no such request (freed after its timeout, "
                                                    "or restarted)"}
            return json.dumps(progress).encode()
        raise ValueError(f"unknown kind {kind!r}")

    def drain_released(self) -> list[str]:
        """Requests every reader has released since the last call."""
        out = []
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                return out

    def forget(self, request_ids: list[str]) -> None:
        """Drops partial releases of requests the producer freed anyway (their timeout passed)."""
        for request_id in request_ids:
            self._readers.pop(request_id, None)  # a stale entry at worst; only the serving thread adds

    def partially_released(self) -> list[str]:
        """Requests some but not all of whose consumer readers have released them."""
        return list(self._readers)


class SideChannelError(RuntimeError):
    """The producer's side channel did not answer, or answered with an error."""


def ask(host: str, port: int, message: dict[str, Any], timeout_ms: int = REQUEST_TIMEOUT_MS) -> dict[str, Any]:
    """One request to a producer's side channel and its JSON answer; SideChannelError when the
    producer does not answer within `timeout_ms` (it may be gone) or answers with an error."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    try:
        socket.connect(f"tcp://{host}:{port}")
        socket.send(json.dumps(message).encode())
        reply = json.loads(socket.recv())
    except zmq.Again:
        raise SideChannelError(f"the producer's side channel at {host}:{port} did not answer "
                               f"{message['kind']!r} within {timeout_ms / 1000:.0f} s") from None
    finally:
        socket.close(0)
    if "error" in reply:
        raise SideChannelError(f"the producer's side channel at {host}:{port}: {reply['error']}")
    return reply


def handshake(host: str, port: int) -> tuple[str, list[RankLayout]]:
    """The producer's engine id and every producer rank's cache layout."""
    reply = ask(host, port, {"kind": "handshake"})
    return str(reply["engine_id"]), [RankLayout.from_json(layout) for layout in reply["layouts"]]
