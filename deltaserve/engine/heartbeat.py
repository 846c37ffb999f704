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


class _Beater:
    """A daemon thread calling `beat()` every `interval_s` until `stop()`."""

    def __init__(self, name: str, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5 * self.interval_s)

    def _run(self) -> None:
        try:
            self.setup()
            while not self._stop.is_set():
                self.beat()
                self._stop.wait(self.interval_s)
        except zmq.ZMQError as e:  # the context was terminated under us: the process is stopping
            logger.debug("%s stopped: %s", self._thread.name, e)
        finally:
            self.teardown()

    def setup(self) -> None: ...

    def beat(self) -> None: ...

    def teardown(self) -> None: ...


class CoreHeartbeat(_Beater):
    """The engine core's beat: publishes how long the current step has been running."""

    def __init__(self, context: zmq.Context, address: str, busy_for_s: Callable[[], float],
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        super().__init__("deltaserve-core-heartbeat", interval_s)
        self.context = context
        self.address = address
        self.busy_for_s = busy_for_s
        self.socket: zmq.Socket | None = None
        self._bound = threading.Event()

    def start(self) -> None:
        super().start()
        self._bound.wait(5.0)  # front ends may connect as soon as the core reports ready

    def setup(self) -> None:
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.address)
        self._bound.set()

    def beat(self) -> None:
        assert self.socket is not None
        self.socket.send(_dumps(("heartbeat", self.busy_for_s())))

    def teardown(self) -> None:
        self._bound.set()
        if self.socket is not None:
            self.socket.close(0)


class FrontendHeartbeat(_Beater):
    """A front end's beat to the core, naming the routing id of its request socket."""

    def __init__(self, context: zmq.Context, address: str, frontend_id: bytes,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        super().__init__("deltaserve-frontend-heartbeat", interval_s)
        self.context = context
        self.address = address
        self.frontend_id = frontend_id
        self.socket: zmq.Socket | None = None

    def setup(self) -> None:
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 4)  # a core that is not reading needs no backlog of beats
        self.socket.connect(self.address)

    def beat(self) -> None:
        assert self.socket is not None
        try:
            self.socket.send(_dumps(("heartbeat", self.frontend_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the queue is full: the core has not read the last few; it will see one of them

    def teardown(self) -> None:
        if self.socket is not None:
            self.socket.close(0)


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
