"""`AsyncLLM`: the front-end side of the engine, in an API server process.

It tokenizes and validates (InputProcessor), sends token ids to the engine-core process over a
ZeroMQ DEALER socket, and turns what comes back into `RequestOutput`s (OutputProcessor): the
detokenizer runs here, never in the engine loop. One reader task receives every output and hands
each to its request's queue. A consumer that falls behind gets only the newest output, which is
cumulative, so nothing is lost.

Leaving `generate()` early (the client disconnected, the task was cancelled) aborts the request in
the core, which frees its blocks, state slots and checkpoint pins.

Liveness (with `WatchSettings`): a thread beats to the core so that a front end that dies has its
requests aborted there, and an `EngineWatch` notices a core (or launcher) that is gone; then every
open request fails with `EngineDeadError` and new ones are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from deltaserve.engine.core import EngineCoreRequest
from deltaserve.engine.engine_watch import EngineWatch, WatchSettings, cancel_and_wait
from deltaserve.engine.heartbeat import Heartbeat, frontend_heartbeat
from deltaserve.engine.output_processor import OutputProcessor
from deltaserve.engine.processor import InputProcessor, ModelInfo, PromptInput
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped answering."""


class _Stream:
    """The newest output of one request, and an event set when it changes."""

    def __init__(self) -> None:
        self.latest: RequestOutput | None = None
        self.error: Exception | None = None
        self.event = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(item, Exception):
            self.error = item
        else:
            self.latest = item
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        item, self.latest = self.latest, None
        assert item is not None
        return item


class AsyncLLM:
    """Talks to one engine-core process. Create it inside the event loop that will use it."""

    def __init__(self, address: str, info: ModelInfo, max_logprobs: int, watch: WatchSettings | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.info = info
        self.processor = InputProcessor(info, max_logprobs)
        self.output_processor = OutputProcessor(info.tokenizer)
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.frontend_id = f"frontend-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self.socket.setsockopt(zmq.ROUTING_ID, self.frontend_id)
        self.socket.connect(address)
        self._on_dead = on_dead
        self._beat_context: zmq.Context | None = None
        self._heartbeat: Heartbeat | None = None
        self.watch: EngineWatch | None = None
        if watch is not None:
            self._beat_context = zmq.Context()  # the beat thread's socket is a blocking one
            self._heartbeat = frontend_heartbeat(self._beat_context, address, self.frontend_id)
            self.watch = EngineWatch(self.context, self.socket, watch, self.mark_dead)
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._pending_sends: set[asyncio.Task] = set()
        self.dead: Exception | None = None

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
            if self._heartbeat is not None:
                self._heartbeat.start()
            if self.watch is not None:
                self.watch.start()

    def problem(self) -> str | None:
        """None while the core is alive and making progress, else why not (what /health reports)."""
        if self.dead is not None:
            return str(self.dead)
        return self.watch.problem() if self.watch is not None else None

    def mark_dead(self, reason: str) -> None:
        """The core is gone (or this server is stopping): fail every open request and refuse new ones."""
        if self.dead is None:
            self.dead = EngineDeadError(reason)
        self.fail_all(reason)
        if self._on_dead is not None:
            self._on_dead(reason)

    def fail_all(self, reason: str) -> None:
        """End every open request and call with EngineDeadError(reason); a live core aborts them."""
        request_ids = list(self._streams)
        for stream in self._streams.values():
            stream.put(EngineDeadError(reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        if self.dead is None:
            self.abort_soon(request_ids)
        else:
            self._streams.clear()
            self.output_processor.abort(request_ids)

    async def close(self) -> None:
        if self._pending_sends:  # aborts still on their way out (queued at once while the core is there)
            await asyncio.wait(self._pending_sends, timeout=1.0)
        if self.watch is not None:
            await self.watch.stop()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        await cancel_and_wait(self._reader)
        self._reader = None
        self.socket.close(0)
        self.context.term()
        if self._beat_context is not None:
            self._beat_context.term()

    # Sending ---------------------------------------------------------------------------------
    async def _send(self, message: tuple) -> None:
        await self.socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    async def call(self, name: str, timeout_s: float = 10.0) -> Any:
        """Ask the core for "ping", "stats" (its get_metrics() dict) or "metrics_text" (Prometheus)."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self.start()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(("call", call_id, name))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError as e:
            raise EngineDeadError(f"the engine core did not answer {name!r} within {timeout_s} s") from e
        finally:
            self._calls.pop(call_id, None)

    def abort_soon(self, request_ids: list[str]) -> asyncio.Task | None:
        """Forget the requests now and send their abort in a task of its own: safe to call from a
        `finally` of a cancelled task, where any await would be cancelled again."""
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        self.output_processor.abort(live)
        if not live:
            return None
        task = asyncio.get_running_loop().create_task(self._send(("abort", live)))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)
        return task

    # Requests --------------------------------------------------------------------------------
    def process_input(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                      arrival_time: float | None = None):
        """Tokenize and validate without sending anything; raises ValueError naming the field."""
        return self.processor.process(request_id, prompt, params, arrival_time)

    async def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the finished one. Bad input raises ValueError before
        anything is sent; leaving early aborts the request in the core."""
        text, core_request = self.processor.process(request_id, prompt, params, arrival_time)
        async for output in self.generate_processed(text, core_request):
            yield output

    async def generate_processed(self, prompt_text: str | None, core_request: EngineCoreRequest,
                                 ) -> AsyncIterator[RequestOutput]:
        """`generate` for a request `process_input` has already tokenized and validated."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        request_id = core_request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        self.start()
        stream = _Stream()
        self._streams[request_id] = stream
        self.output_processor.add_request(request_id, prompt_text, core_request.prompt_token_ids,
                                          core_request.params)
        finished = False
        try:
            await self._send(("add", core_request))
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort_soon([request_id])
            self._streams.pop(request_id, None)

    # Receiving -------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                message = pickle.loads(await self.socket.recv())
                kind = message[0]
                if kind == "outputs":
                    await self._on_outputs(message[1])
                elif kind in ("error", "aborted"):
                    _, request_id, text = message
                    self.output_processor.abort([request_id])
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put(ValueError(text) if kind == "error" else EngineDeadError(text))
                elif kind == "reply":
                    future = self._calls.get(message[1])
                    if future is not None and not future.done():
                        future.set_result(message[2])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken socket or message: every waiting request fails, loudly
            logger.exception("front end: lost the engine core")
            self.mark_dead(f"lost the engine core: {e}")
            raise

    async def _on_outputs(self, core_outputs: list) -> None:
        outputs, stopped_by_string = self.output_processor.process(core_outputs)
        if stopped_by_string:
            await self._send(("stop", stopped_by_string))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]
