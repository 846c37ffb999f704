"""One concurrency level: send the workload's requests under its limits and keep every record.

How requests are sent follows the workload's mode:
  - "queue": `concurrency` workers each send the next request as soon as their last one ends;
  - "timestamps": each request is sent at its `arrival_s` after the level starts, or later when
    `concurrency` requests are already in flight (its TTFT then counts from when it was sent);
  - "sessions": `concurrency` slots each run agentic sessions one after another: a turn, then the
    session's think time, then the next turn; slot i runs sessions i, i + C, i + 2C, ...

Limits: `num_requests` per level (split evenly over the slots for sessions, the first slots taking
one more, so the requests sent do not depend on timing) and `duration_s` (no request is sent after
it; those in flight finish). Setting `stop` (Ctrl-C) cancels what is in flight: those records are
marked cancelled and the level ends with what was measured.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltaserve.bench.prefix_oracle import block_keys
from deltaserve.bench.serve.client import CompletionClient, PrefixCacheCounters
from deltaserve.bench.serve.records import RequestRecord, RequestSpec


class Observer(Protocol):
    """What the runner reports as it goes (the progress bar is one)."""

    def level_started(self, level_index: int, concurrency: int, planned: int | None) -> None: ...

    def request_done(self, record: RequestRecord) -> None: ...

    def level_finished(self) -> None: ...


@dataclass
class LevelRun:
    """The raw outcome of one level, before `metrics.summarize_level`."""

    concurrency: int
    records: list[RequestRecord]
    duration_s: float
    counters: tuple[PrefixCacheCounters | None, PrefixCacheCounters | None]
    interrupted: bool
    workload_stats: dict[str, Any] = field(default_factory=dict)


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` as `parts` counts differing by at most one, the larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class Runner:
    """Runs levels of one workload against one client; `stop` ends the current level early."""

    def __init__(self, client: CompletionClient, workload: Any, *, duration_s: float | None,
                 oracle_block_size: int, stop: asyncio.Event | None = None, observer: Observer | None = None,
                 ) -> None:
        self.client = client
        self.workload = workload
        self.duration_s = duration_s
        self.oracle_block_size = oracle_block_size
        self.stop = stop or asyncio.Event()
        self.observer = observer
        self.num_requests: int | None = None
        self._records: list[RequestRecord] = []
        self._deadline: float | None = None
        self._stats: dict[str, Any] = {}

    def planned(self) -> int | None:
        """How many requests the level will send, when that is known in advance."""
        if self.duration_s is not None or self.num_requests is None:
            return None
        size = self.workload.size
        return self.num_requests if size is None else min(size, self.num_requests)

    async def run_level(self, level_index: int, concurrency: int, num_requests: int | None) -> LevelRun:
        """Send one level's requests at `concurrency`, at most `num_requests` of them (None: until the
        duration or the workload ends); the server's cache counters before and after."""
        if num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration (or both): a level needs an end")
        self.num_requests = num_requests
        self._records, self._stats = [], {}
        before = await self.client.prefix_cache_counters()
        if self.observer is not None:
            self.observer.level_started(level_index, concurrency, self.planned())
        start = time.perf_counter()
        self._deadline = None if self.duration_s is None else start + self.duration_s
        if self.workload.mode == "sessions":
            drivers = self._session_slots(level_index, concurrency)
        elif self.workload.mode == "timestamps":
            drivers = [self._dispatch_by_timestamp(level_index, concurrency, start)]
        else:
            specs = self._limited(self.workload.requests(level_index))
            drivers = [self._queue_worker(specs) for _ in range(concurrency)]
        await self._until_done_or_stopped(drivers)
        if self.observer is not None:
            self.observer.level_finished()
        after = await self.client.prefix_cache_counters()
        sent = [r for r in self._records if r.end_time is not None]
        duration = max(r.end_time for r in sent) - min(r.send_time for r in sent) if sent else 0.0
        return LevelRun(concurrency, self._records, duration, (before, after), self.stop.is_set(), self._stats)

    # ---------------------------------------------------------------- sending

    def _may_send(self) -> bool:
        return not self.stop.is_set() and (self._deadline is None or time.perf_counter() < self._deadline)

    def _limited(self, specs: Iterator[RequestSpec]) -> Iterator[RequestSpec]:
        return specs if self.num_requests is None else itertools.islice(specs, self.num_requests)

    async def _send(self, spec: RequestSpec) -> RequestRecord:
        record = RequestRecord(len(self._records), len(spec.prompt_token_ids), spec.max_tokens,
                               session_id=spec.session_id, turn=spec.turn)
        self._records.append(record)
        await self.client.send(spec, record)
        if record.ok:
            record.block_keys = block_keys(spec.prompt_token_ids + (record.output_token_ids or []),
                                           self.oracle_block_size)
        if self.observer is not None:
            self.observer.request_done(record)
        return record

    async def _until_done_or_stopped(self, drivers: list[Coroutine]) -> None:
        """Run the drivers to their end, or until `stop` is set; then cancel what is left."""
        tasks = {asyncio.ensure_future(d) for d in drivers}
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            while tasks and not stopper.done():
                done, _ = await asyncio.wait(tasks | {stopper}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {stopper}:
                    tasks.discard(task)
                    task.result()  # a driver's own bug surfaces here
        finally:
            stopper.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)

    # ---------------------------------------------------------------- the three modes

    async def _queue_worker(self, specs: Iterator[RequestSpec]) -> None:
        while self._may_send():
            spec = next(specs, None)
            if spec is None:
                return
            await self._send(spec)

    async def _dispatch_by_timestamp(self, level_index: int, concurrency: int, start: float) -> None:
        slots = asyncio.Semaphore(concurrency)
        in_flight: set[asyncio.Task] = set()

        async def send_and_release(spec: RequestSpec) -> None:
            try:
                await self._send(spec)
            finally:
                slots.release()

        try:
            for spec in self._limited(self.workload.requests(level_index)):
                delay = start + (spec.arrival_s or 0.0) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await slots.acquire()
                if not self._may_send():
                    slots.release()
                    break
                task = asyncio.ensure_future(send_and_release(spec))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    def _session_slots(self, level_index: int, concurrency: int) -> list[Coroutine]:
        quotas = [None] * concurrency if self.num_requests is None else split_evenly(self.num_requests, concurrency)
        self._stats.update(sessions_started=0, sessions_finished=0, answers_from_server=0)
        return [self._session_slot(level_index, slot, concurrency, quota)
                for slot, quota in enumerate(quotas) if quota != 0]

    async def _session_slot(self, level_index: int, slot: int, concurrency: int, quota: int | None) -> None:
        sent = 0
        for k in itertools.count():
            if not self._may_send() or (quota is not None and sent >= quota):
                return
            session = self.workload.session(level_index, slot + k * concurrency)
            self._stats["sessions_started"] += 1
            while quota is None or sent < quota:
                spec = session.next_request()
                if spec is None:
                    self._stats["sessions_finished"] += 1
                    break
                if not self._may_send():
                    return
                record = await self._send(spec)
                sent += 1
                if not record.ok:
                    break  # the session ends with its failed turn
                if session.add_turn(record.output_token_ids, spec.max_tokens):
                    self._stats["answers_from_server"] += 1
                think = session.think_time()
                if think > 0:
                    await asyncio.sleep(think)
            if session.turn == 0:
                return  # a session that cannot take one turn would loop forever
