"""Heartbeats between the engine core and the API front ends, each sent from a thread of its own.

A ZeroMQ DEALER raises nothing when its peer disappears, and a process stepping a long prefill
answers no message until the step ends, so neither side can learn from the message stream alone
whether the other is alive. Each side therefore sends a small heartbeat on a timer from a thread
(torch kernels and the tokenizer release the GIL, so a busy process still beats):

    core -> front ends   PUB at <workdir>/heartbeat.sock: ("heartbeat", busy_for_s) every
                         HEARTBEAT_INTERVAL_S; busy_for_s is how long the current step has run (0
                         between steps), so a front end tells "busy" from "stuck"
    front end -> core    its own DEALER on the core's socket: ("heartbeat", frontend_id); the core
                         aborts the requests of a front end silent for FRONTEND_SILENT_AFTER_S
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
FRONTEND_SILENT_AFTER_S = 5.0


def _dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class Heartbeat:
    """A daemon thread that sends `message()` every `interval_s` on a socket of its own (made, bound
    or connected, and closed in the thread) until `stop()`. A beat that cannot be queued at once is
    dropped: a peer that is not reading needs no backlog of them."""

    def __init__(self, name: str, context: zmq.Context, socket_type: int, address: str, bind: bool,
                 message: Callable[[], tuple], interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.context = context
        self.socket_type = socket_type
        self.address = address
        self.bind = bind
        self.message = message
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start beating; returns once the socket is bound or connected (peers may connect at once)."""
        self._thread.start()
        self._ready.wait(5.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5 * self.interval_s)

    def _run(self) -> None:
        sock = None
        try:
            sock = self.context.socket(self.socket_type)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            if self.bind:
                sock.bind(self.address)
            else:
                sock.connect(self.address)
            self._ready.set()
            while not self._stop.is_set():
                try:
                    sock.send(_dumps(self.message()), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self._stop.wait(self.interval_s)
        except zmq.ZMQError as e:  # the context was terminated under us: the process is stopping
            logger.debug("%s stopped: %s", self._thread.name, e)
        finally:
            self._ready.set()
            if sock is not None:
                sock.close(0)


def core_heartbeat(context: zmq.Context, address: str, busy_for_s: Callable[[], float],
                   interval_s: float = HEARTBEAT_INTERVAL_S) -> Heartbeat:
    """The engine core's beat: a PUB at `address` saying how long the current step has run."""
    return Heartbeat("deltaserve-core-heartbeat", context, zmq.PUB, address, True,
                     lambda: ("heartbeat", busy_for_s()), interval_s)


def frontend_heartbeat(context: zmq.Context, address: str, frontend_id: bytes,
                       interval_s: float = HEARTBEAT_INTERVAL_S) -> Heartbeat:
    """A front end's beat to the core: its own DEALER, naming the routing id of the request socket."""
    return Heartbeat("deltaserve-frontend-heartbeat", context, zmq.DEALER, address, False,
                     lambda: ("heartbeat", frontend_id), interval_s)


class FrontendRegistry:
    """The core's view of its front ends: when each was last heard from, and which are silent."""

    def __init__(self, silent_after_s: float = FRONTEND_SILENT_AFTER_S) -> None:
        self.silent_after_s = silent_after_s
        self._last_seen: dict[bytes, float] = {}

    def seen(self, frontend_id: bytes, now: float | None = None) -> None:
        self._last_seen[frontend_id] = time.monotonic() if now is None else now

    def silent(self, frontend_ids: set[bytes], now: float | None = None) -> list[bytes]:
        """Those of `frontend_ids` not heard from for `silent_after_s`; they are forgotten."""
        now = time.monotonic() if now is None else now
        gone = [f for f in frontend_ids if now - self._last_seen.get(f, now) > self.silent_after_s]
        for f in gone:
            self._last_seen.pop(f, None)
        return gone
