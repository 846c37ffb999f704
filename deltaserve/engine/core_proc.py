"""The engine-core process: an `EngineCore` stepping in a loop, fed over ZeroMQ by the API front ends.

One ROUTER socket serves every front end (each connects a DEALER). Messages are pickled tuples
between processes of one server on one host:

    front end -> core: ("add", EngineCoreRequest) | ("abort", [ids]) | ("stop", [ids])
                       | ("call", call_id, name)      name: "metrics_text" | "stats" | "ping"
                       | ("heartbeat", frontend_id)   from the front end's heartbeat thread
    core -> front end: ("outputs", [EngineCoreOutput]) | ("error", request_id, message)
                       | ("aborted", request_id, message) | ("reply", call_id, result)

An EngineCoreOutput pickles whole, so a P/D producer's `kv_transfer_params` (set on its finished
output) reaches the front end, which puts it on the finished `RequestOutput`.

"error" refuses a request the core cannot take (the front end answers 400); "aborted" ends one the
core gave up on (503).

Liveness (heartbeat.py): a thread publishes the core's heartbeat at `heartbeat_address(address)`;
the requests of a front end that has stopped beating are aborted, so a front end killed with
streams open frees its blocks, slots and pins.

"stop" finishes requests whose stop string a front end found (their state is filed for prefix
caching); "abort" frees everything a request holds. The loop drains every message before each step,
so an abort lands before the next schedule.

SIGTERM ends the loop after the current step; SIGINT is ignored (the launcher that owns this process
decides when it stops, after the front ends have drained). If the launcher dies, so does this, at
the end of the step it is in.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import zmq

from deltaserve.config.engine_config import EngineConfig
from deltaserve.core.request import RequestStatus
from deltaserve.engine.core import EngineCore, EngineCoreRequest
from deltaserve.engine.heartbeat import HEARTBEAT_INTERVAL_S, FrontendRegistry, core_heartbeat
from deltaserve.engine.processor import ModelInfo
from deltaserve.metrics.prometheus import EngineMetrics
from deltaserve.metrics.stats_logger import StatsLogger

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100
_TRANSFER_POLL_MS = 1  # ms between the steps of an engine whose requests all wait for P/D loads


def heartbeat_address(address: str) -> str:
    """Where the core at `address` (ipc://DIR/core.sock) publishes its heartbeat."""
    return address.rsplit("/", 1)[0] + "/heartbeat.sock"


@dataclass
class CoreReady:
    """What the core reports once its model and caches are up."""

    model_dir: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int  # tokens per scheduler block (block_size x decode_context_parallel_size)
    num_state_slots: int
    num_checkpoint_units: int
    checkpoint_unit_bytes: int
    cache_bytes: int
    device: str
    dtype: str

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of context the KV cache holds over all requests (grows with the DCP group)."""
        return self.num_kv_blocks * self.block_size


class EngineCoreProc:
    """Owns the socket and the loop; `run()` returns when told to stop."""

    def __init__(self, config: EngineConfig, address: str, served_model_name: str,
                 log_stats_interval_s: float = 5.0) -> None:
        info = ModelInfo.load(config)
        self.core = EngineCore(config, info.model_dir, info.model_config, info.max_model_len, info.eos_token_ids)
        plan = self.core.cache_plan
        executor = self.core.executor
        self.ready = CoreReady(
            info.model_dir, info.max_model_len, plan.num_blocks, config.scheduler_block_size, plan.num_state_slots,
            plan.num_checkpoint_units, plan.checkpoint_unit_bytes, plan.total_bytes,
            executor.device_name, executor.dtype_name,
        )
        self.metrics = EngineMetrics(served_model_name, info.max_model_len)
        self.stats_logger = StatsLogger(log_stats_interval_s) if log_stats_interval_s > 0 else None
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._owners: dict[str, bytes] = {}  # request id -> the front end that sent it
        self._frontends = FrontendRegistry()
        self._next_liveness_check = 0.0
        self._step_started: float | None = None
        self.heartbeat = core_heartbeat(self.context, heartbeat_address(address), self._busy_for_s)
        self._stopping = False

    def _busy_for_s(self) -> float:
        started = self._step_started  # one read: the loop thread may clear it meanwhile
        return 0.0 if started is None else time.monotonic() - started

    def request_stop(self, *_: Any) -> None:
        self._stopping = True

    # Messages --------------------------------------------------------------------------------
    def _send(self, identity: bytes, message: tuple) -> None:
        self.socket.send_multipart([identity, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)])

    def _handle(self, identity: bytes, message: tuple) -> None:
        kind = message[0]
        if kind == "heartbeat":
            self._frontends.seen(message[1])
            return
        self._frontends.seen(identity)
        if kind == "add":
            request: EngineCoreRequest = message[1]
            try:
                self.core.add_request(request)
            except ValueError as e:
                self._send(identity, ("error", request.request_id, str(e)))
                return
            self._owners[request.request_id] = identity
        elif kind in ("abort", "stop"):
            ids = [rid for rid in message[1] if self._owners.pop(rid, None) is not None]
            status = RequestStatus.FINISHED_ABORTED if kind == "abort" else RequestStatus.FINISHED_STOPPED
            self.core.finish_requests(ids, status)
            if kind == "abort":
                self.metrics.record_aborts(len(ids))
        elif kind == "call":
            _, call_id, name = message
            self._send(identity, ("reply", call_id, self._call(name)))
        else:
            logger.warning("engine core: unknown message %r ignored", kind)

    def _call(self, name: str) -> Any:
        if name == "ping":
            return "pong"
        if name == "stats":
            return self.core.get_metrics()
        if name == "metrics_text":
            self.metrics.record_snapshot(self.core.get_metrics())
            return self.metrics.exposition()
        return None

    def _message_wait_ms(self) -> int:
        """How long the loop waits for messages before its next turn: not at all while there is work,
        a millisecond while every request only waits for its KV transfer (a step would only poll it),
        and the idle interval otherwise."""
        if not self.core.has_unfinished_requests():
            return _IDLE_POLL_MS
        return _TRANSFER_POLL_MS if self.core.waiting_only_on_transfers() else 0

    def _drain(self, timeout_ms: int) -> None:
        while self.socket.poll(timeout_ms):
            identity, payload = self.socket.recv_multipart()
            self._handle(identity, pickle.loads(payload))
            timeout_ms = 0

    def _abort_silent_frontends(self) -> None:
        """Abort the requests of front ends that stopped beating (killed, or hung); looked at once per
        heartbeat interval, not on every pass of the loop."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + HEARTBEAT_INTERVAL_S
        gone = set(self._frontends.silent(set(self._owners.values()), now))
        if not gone:
            return
        ids = [rid for rid, owner in self._owners.items() if owner in gone]
        logger.error("engine core: %d API front end(s) stopped sending heartbeats; aborting their %d request(s)",
                     len(gone), len(ids))
        for rid in ids:
            identity = self._owners.pop(rid)
            self._send(identity, ("aborted", rid, "the engine core aborted this request: its API front end "
                                                 "stopped sending heartbeats"))
        self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.metrics.record_aborts(len(ids))

    # The loop --------------------------------------------------------------------------------
    def run(self, parent_pid: int | None = None) -> None:
        self.heartbeat.start()
        while not self._stopping:
            self._drain(self._message_wait_ms())
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.error("engine core: the launcher is gone; exiting")
                break
            self._abort_silent_frontends()
            if not self.core.has_unfinished_requests():
                self.core.poll_transfers()  # a P/D producer frees what its consumers have read
                self._maybe_log()
                continue
            self._step_started = time.monotonic()
            try:
                outputs, stats = self.core.step()
            finally:
                self._step_started = None
            self.metrics.record_step(stats)  # gauges and running totals are read at scrape time
            if self.stats_logger is not None:
                self.stats_logger.record(stats)
            by_owner: dict[bytes, list] = defaultdict(list)
            for out in outputs:
                identity = self._owners.get(out.request_id)
                if identity is None:
                    continue
                by_owner[identity].append(out)
                if out.finish_reason is not None:
                    del self._owners[out.request_id]
            for identity, outs in by_owner.items():
                self._send(identity, ("outputs", outs))
            if self.core.kv_transfer is not None:  # P/D consumer: loads that failed under the "fail" policy
                for request_id, message in self.core.kv_transfer.take_failures():
                    identity = self._owners.pop(request_id, None)
                    if identity is not None:
                        self._send(identity, ("aborted", request_id, message))
            self._maybe_log()
        self.shutdown()

    def _maybe_log(self) -> None:
        if self.stats_logger is not None and self.stats_logger.due():
            self.stats_logger.maybe_log(self.core.get_metrics())

    def shutdown(self) -> None:
        live = list(self._owners)
        if live:
            logger.info("engine core: aborting %d unfinished request(s) at shutdown", len(live))
            self.core.finish_requests(live)
        self._owners.clear()
        self.heartbeat.stop()
        self.socket.close(0)
        self.context.term()
        self.core.shutdown()


def run_engine_core(config: EngineConfig, address: str, served_model_name: str, log_stats_interval_s: float,
                    ready_pipe: Any, log_level: str = "INFO") -> None:
    """Process entry point: build the core, report `CoreReady` (or the error) on `ready_pipe`, loop."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    try:
        proc = EngineCoreProc(config, address, served_model_name, log_stats_interval_s)
    except Exception as e:  # report why startup failed to the launcher, which prints it
        ready_pipe.send(("error", f"{type(e).__name__}: {e}"))
        ready_pipe.close()
        raise SystemExit(1) from e
    signal.signal(signal.SIGTERM, proc.request_stop)
    ready_pipe.send(("ready", proc.ready))
    ready_pipe.close()
    started = time.monotonic()
    proc.run(parent_pid)
    logger.info("engine core: stopped after %.0f s", time.monotonic() - started)
