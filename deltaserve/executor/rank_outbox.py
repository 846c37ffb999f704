"""A rank's way back to the engine: every message it sends, in order, including the outputs of steps
still running on its device.

Runs in each rank process (`executor/rank_process.py`). The rank's main thread launches a step
without waiting for the device and queues what the step will send here; it then goes on to the next
step, so its host work for step N+1 (preparing inputs, launching kernels) runs while step N is on the
device, as in the in-process executor under async scheduling. A sender thread resolves queued steps
in order (waiting for each one's copy to the host, with the GIL free) and sends their messages.

A message that is ready when nothing is queued ahead of it is sent by the calling thread at once: on
the CPU every step's output is ready when the step returns, so that path gains no thread hop. The
socket is used by one thread at a time (under a lock), and messages leave in the order they were put.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

from deltaserve.executor.transport import RankChannels

# what a queued entry produces once resolved: (kind, *payload) messages for the engine
Messages = Callable[[], list[tuple[Any, ...]]]
CLOSE_TIMEOUT_S = 5.0  # how long closing waits for queued steps (a hung device must not hang shutdown)


class RankOutbox:
    """Sends a rank's messages to the engine, in order; see the module docstring."""

    def __init__(self, channels: RankChannels, on_failure: Callable[[str], None]) -> None:
        """`on_failure(traceback_text)` is called from the sender thread when resolving a queued entry
        raised; nothing is sent after that but `send_error`."""
        self._channels = channels
        self._on_failure = on_failure
        self._lock = threading.Lock()  # guards the socket and _pending
        self._pending = 0  # entries queued and not yet sent
        self._queue: queue.Queue[Messages | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def send(self, kind: str, *payload: Any) -> None:
        """Send (kind, *payload) now, or behind what is queued."""
        self.put(lambda: [(kind, *payload)], ready=True)

    def put(self, messages: Messages, ready: bool) -> None:
        """Send what `messages()` returns, after everything put before. With `ready` (it returns at
        once) and nothing queued, it runs and is sent in this thread; else the sender thread does both."""
        with self._lock:
            if ready and self._pending == 0:
                for message in messages():
                    self._channels.send(*message)
                return
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rank-outbox", daemon=True)
            self._thread.start()
        self._queue.put(messages)

    def send_error(self, text: str) -> None:
        """Send ("error", text) now, ahead of anything still queued (the rank is going down)."""
        with self._lock:
            self._channels.send("error", text)

    def close(self) -> None:
        """Send what is queued (waiting up to CLOSE_TIMEOUT_S) and stop the sender thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        while (messages := self._queue.get()) is not None:
            try:
                resolved = messages()
            except BaseException:
                self._on_failure(traceback.format_exc())
                return
            with self._lock:
                for message in resolved:
                    self._channels.send(*message)
                self._pending -= 1
