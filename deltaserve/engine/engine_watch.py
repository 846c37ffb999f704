"""A front end's watch on the engine core and on the launcher that started them both.

Three signs that the core is gone, checked every heartbeat interval:
- the request socket's connection to the core dropped (a ZeroMQ monitor event: the core process
  exited, however it died);
- no heartbeat from the core for `silent_after_s` (a process that is alive but frozen);
- the launcher is gone (this process was re-parented), so nothing supervises the server any more.

Any of them calls `on_gone(reason)` once. Short of gone, `problem()` says whether the core is
healthy: a core in one step for longer than `stuck_after_s` is reported stuck, a busy core that keeps
finishing steps is not.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from deltaserve.engine.heartbeat import HEARTBEAT_INTERVAL_S

logger = logging.getLogger(__name__)

ENGINE_SILENT_AFTER_S = 10.0
DEFAULT_STUCK_AFTER_S = 60.0


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has ended, whatever it raised."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


@dataclass
class WatchSettings:
    """Where the core's heartbeat is published, whose child this process is, and the time limits."""

    heartbeat_address: str
    launcher_pid: int | None = None
    stuck_after_s: float = DEFAULT_STUCK_AFTER_S
    silent_after_s: float = ENGINE_SILENT_AFTER_S


class EngineWatch:
    """Runs as a task in the front end's event loop; `problem()` is what /health reports."""

    def __init__(self, context: zmq.asyncio.Context, request_socket: zmq.asyncio.Socket, settings: WatchSettings,
                 on_gone: Callable[[str], None]) -> None:
        self.context = context
        self.request_socket = request_socket
        self.settings = settings
        self.on_gone = on_gone
        self.gone_reason: str | None = None
        self._last_beat = time.monotonic()
        self._busy_for_s = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def problem(self, now: float | None = None) -> str | None:
        """None while the core is alive and making progress, else why it is not."""
        if self.gone_reason is not None:
            return self.gone_reason
        now = time.monotonic() if now is None else now
        in_step_for = self._busy_for_s + now - self._last_beat  # the step the last beat saw, and since
        if in_step_for > self.settings.stuck_after_s:
            return f"the engine core has made no progress for {in_step_for:.1f} s (one step or no heartbeat)"
        return None

    def _gone(self, reason: str) -> None:
        if self.gone_reason is None:
            self.gone_reason = reason
            logger.error("front end: %s", reason)
            self.on_gone(reason)

    async def _run(self) -> None:
        beats = self.context.socket(zmq.SUB)
        beats.setsockopt(zmq.LINGER, 0)
        beats.setsockopt(zmq.SUBSCRIBE, b"")
        beats.connect(self.settings.heartbeat_address)
        monitor = self.request_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(beats, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while self.gone_reason is None:
                ready = dict(await poller.poll(int(HEARTBEAT_INTERVAL_S * 1000)))
                if beats in ready:
                    await self._read_beats(beats)
                if monitor in ready:
                    self._check_launcher()  # the core exits when the launcher dies: name the first cause
                    self._gone("lost the engine core: its connection closed (the process exited)")
                    break
                self._check_launcher()
                self._check_heartbeat(time.monotonic())
        finally:
            poller.unregister(beats)
            poller.unregister(monitor)
            beats.close(0)
            self.request_socket.disable_monitor()
            monitor.close(0)

    async def _read_beats(self, beats: zmq.asyncio.Socket) -> None:
        while True:  # every queued beat: after a pause of this loop, the newest one counts
            try:
                message = pickle.loads(await beats.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._last_beat = time.monotonic()
            self._busy_for_s = float(message[1])

    def _check_launcher(self) -> None:
        launcher = self.settings.launcher_pid
        if launcher is not None and os.getppid() != launcher:
            self._gone(f"the launcher (pid {launcher}) is gone; this front end is stopping")

    def _check_heartbeat(self, now: float) -> None:
        silent = now - self._last_beat
        if silent > self.settings.silent_after_s:
            self._gone(f"lost the engine core: no heartbeat for {silent:.1f} s")
