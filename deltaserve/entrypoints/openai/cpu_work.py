"""Request work that is CPU-bound (tokenizing long prompts, rendering chat templates), off the event loop.

One small thread pool per front end runs it, so a long prompt or a slow template never stalls the
loop (health checks, other streams), and at most `max_workers` such jobs run at once, which bounds
the memory they take together. A job that runs longer than its time limit gets the request a 400;
its thread cannot be interrupted and finishes in the background, still holding its slot, so the
bound stays true.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from deltaserve.entrypoints.openai.errors import OpenAIError

T = TypeVar("T")

DEFAULT_MAX_WORKERS = 2
DEFAULT_TIME_LIMIT_S = 10.0


class CpuWork:
    """A bounded pool for a front end's CPU-bound request work. Create it inside the event loop."""

    def __init__(self, max_workers: int = DEFAULT_MAX_WORKERS, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> None:
        self.time_limit_s = time_limit_s
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="deltaserve-cpu-work")
        self._slots = asyncio.Semaphore(max_workers)

    async def run(self, what: str, param: str | None, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the pool, timed from when it starts (not while it queues). Raises
        OpenAIError(400) naming `what` and `param` past the time limit; `fn`'s own errors pass through."""
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._executor, fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())  # when the thread is really done
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.time_limit_s)
        except asyncio.TimeoutError:
            future.add_done_callback(_discard_result)
            raise OpenAIError(f"{param or 'request'}: {what} took longer than the {self.time_limit_s:g} s limit",
                              400, param=param) from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _discard_result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so an abandoned job's error is not reported as never retrieved
