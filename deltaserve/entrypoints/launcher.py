"""`deltaserve serve`: start the engine-core process and N API front ends, supervise, shut down cleanly.

    launcher (this process: no model, no tokenizer)
      |- engine core process      ROUTER socket at ipc://<tmp>/core.sock, the model and caches
      |- API front end 0..N-1     uvicorn on one shared listening socket, DEALER to the core

The launcher binds the listening socket first (so a taken port fails at once, `--port 0` works, and
every front end accepts on the same port), starts the core and waits for its `CoreReady`, then
starts the front ends. SIGTERM or SIGINT: the front ends stop accepting and drain (open requests
finish, or end with an error event after `--shutdown-timeout`, which aborts them in the core); then
the core stops; exit 0.

Nothing is restarted. If a child dies on its own, the launcher logs which one and how, stops the core
first (so every front end sees it gone and ends its open streams with an error event at once), then
the front ends, and exits with EXIT_ENGINE_CORE_DIED or EXIT_API_SERVER_DIED. The children watch the
launcher too: if it is killed, the core stops after its current step and each front end ends its
streams with an error event and exits, releasing the port.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.core_proc import CoreReady, heartbeat_address, run_engine_core
from deltaserve.engine.engine_watch import DEFAULT_STUCK_AFTER_S
from deltaserve.entrypoints.openai.api_server import (
    DEFAULT_MAX_BODY_BYTES,
    EXIT_ENGINE_GONE,
    FrontendSettings,
    run_api_server,
)
from deltaserve.entrypoints.openai.cpu_work import DEFAULT_TIME_LIMIT_S
from deltaserve.entrypoints.openai.http_protocol import DEFAULT_HEADER_TIMEOUT_S

logger = logging.getLogger("deltaserve.serve")

EXIT_STARTUP_FAILED = 1
EXIT_ENGINE_CORE_DIED = 3
EXIT_API_SERVER_DIED = 4


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] | None = None
    api_server_count: int = 1
    shutdown_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_stats_interval_s: float = 5.0
    log_level: str = "info"
    trust_request_chat_template: bool = False
    health_stuck_timeout_s: float = DEFAULT_STUCK_AFTER_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    cpu_work_timeout_s: float = DEFAULT_TIME_LIMIT_S

    def __post_init__(self) -> None:
        if not isinstance(self.api_server_count, int) or self.api_server_count < 1:
            raise ValueError(f"api_server_count={self.api_server_count!r} must be an integer >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout_s} must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes={self.max_body_bytes} must be at least 1024")
        if self.health_stuck_timeout_s <= 0:
            raise ValueError(f"health_stuck_timeout={self.health_stuck_timeout_s} must be > 0")
        if self.header_timeout_s <= 0:
            raise ValueError(f"header_timeout={self.header_timeout_s} must be > 0")
        if self.cpu_work_timeout_s <= 0:
            raise ValueError(f"cpu_work_timeout={self.cpu_work_timeout_s} must be > 0")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets of that protocol, and
    # without it every small response on a kept-alive connection waits out Nagle's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server:
    """The processes of one `deltaserve serve`."""

    def __init__(self, engine_config: EngineConfig, options: ServeOptions) -> None:
        self.engine_config = engine_config
        self.options = options
        self.mp = multiprocessing.get_context("spawn")
        self.workdir = tempfile.mkdtemp(prefix="deltaserve-")
        self.address = f"ipc://{os.path.join(self.workdir, 'core.sock')}"
        self.core: multiprocessing.Process | None = None
        self.frontends: list[multiprocessing.Process] = []
        self.sock: socket.socket | None = None
        self._stop_requested = False

    def _request_stop(self, signum: int, _frame: object) -> None:
        if not self._stop_requested:
            logger.info("deltaserve serve: %s received; draining", signal.Signals(signum).name)
        self._stop_requested = True

    @property
    def served_model_names(self) -> list[str]:
        """--served-model-name, else the --model path, else the embedded model's name."""
        return self.options.served_model_name or [self.engine_config.model or "deltaserve-tiny"]

    def start_core(self) -> CoreReady:
        receiver, sender = self.mp.Pipe(duplex=False)
        self.core = self.mp.Process(
            target=run_engine_core, name="deltaserve-engine-core",
            args=(self.engine_config, self.address, self.served_model_names[0], self.options.log_stats_interval_s,
                  sender, self.options.log_level),
        )
        self.core.start()
        sender.close()
        while not receiver.poll(0.2):
            if not self.core.is_alive() or self._stop_requested:
                raise RuntimeError(f"the engine core exited during startup (exit code {self.core.exitcode})")
        try:
            kind, payload = receiver.recv()
        except EOFError as e:
            raise RuntimeError("the engine core exited during startup") from e
        if kind != "ready":
            raise RuntimeError(f"the engine core failed to start: {payload}")
        return payload

    def start_frontends(self, ready: CoreReady) -> None:
        opts = self.options
        assert self.sock is not None
        settings = FrontendSettings(
            engine_config=self.engine_config, engine_address=self.address,
            served_model_names=self.served_model_names,
            api_key=opts.api_key, max_body_bytes=opts.max_body_bytes, shutdown_timeout_s=opts.shutdown_timeout_s,
            log_level=opts.log_level, max_model_len=ready.max_model_len, kv_capacity_tokens=ready.kv_capacity_tokens,
            heartbeat_address=heartbeat_address(self.address), launcher_pid=os.getpid(),
            stuck_after_s=opts.health_stuck_timeout_s, header_timeout_s=opts.header_timeout_s,
            trust_request_chat_template=opts.trust_request_chat_template, cpu_work_timeout_s=opts.cpu_work_timeout_s,
        )
        for index in range(opts.api_server_count):
            proc = self.mp.Process(target=run_api_server, args=(settings, self.sock),
                                   name=f"deltaserve-api-server-{index}")
            proc.start()
            self.frontends.append(proc)

    @property
    def bound_address(self) -> tuple[str, int]:
        assert self.sock is not None
        host, port = self.sock.getsockname()[:2]
        return host, port

    def run(self) -> int:
        """Start everything, wait for a signal or a dead child, shut down. Returns the exit code."""
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            self.sock = _bind(self.options.host, self.options.port)  # fail fast, before loading the model
            ready = self.start_core()
            self.start_frontends(ready)
            self._log_startup(ready)
            while not self._stop_requested and code == 0:
                code = self._check_children()
                time.sleep(0.2)
        except (RuntimeError, ValueError) as e:
            logger.error("deltaserve serve: %s", e)
            code = EXIT_STARTUP_FAILED
        finally:
            self.shutdown(core_first=code != 0)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return code

    def _check_children(self) -> int:
        """0 while every child runs; else log which one died and how, and return the exit code."""
        assert self.core is not None
        if not self.core.is_alive():
            logger.error("deltaserve serve: the engine core (pid %s) died: %s; stopping (exit code %d)",
                         self.core.pid, _describe_exit(self.core.exitcode), EXIT_ENGINE_CORE_DIED)
            return EXIT_ENGINE_CORE_DIED
        for proc in self.frontends:
            if not proc.is_alive():
                cause = EXIT_ENGINE_CORE_DIED if proc.exitcode == EXIT_ENGINE_GONE else EXIT_API_SERVER_DIED
                logger.error("deltaserve serve: %s (pid %s) died: %s; stopping (exit code %d)",
                             proc.name, proc.pid, _describe_exit(proc.exitcode), cause)
                return cause
        return 0

    def _log_startup(self, ready: CoreReady) -> None:
        host, port = self.bound_address
        gib = ready.cache_bytes / 2**30
        logger.info(
            "deltaserve serve: model %s (served as %s) on %s %s; max_model_len %d; KV cache %d blocks x %d tokens "
            "(%d tokens of context), %d KDA state slots, %d checkpoint units x %d bytes (%.2f GiB in all); "
            "%d API server(s)",
            ready.model_dir, ", ".join(self.served_model_names),
            ready.device, ready.dtype, ready.max_model_len, ready.num_kv_blocks, ready.block_size,
            ready.kv_capacity_tokens,
            ready.num_state_slots, ready.num_checkpoint_units, ready.checkpoint_unit_bytes, gib,
            self.options.api_server_count,
        )
        assert self.core is not None
        logger.info("deltaserve serve: engine core pid %d; API server pids %s", self.core.pid,
                    ", ".join(str(p.pid) for p in self.frontends))
        logger.info("deltaserve serve: ready on http://%s:%d", host if ":" not in host else f"[{host}]", port)

    def shutdown(self, core_first: bool = False) -> None:
        """Stop the front ends (they drain), then the core. After a fault (`core_first`), the core
        stops first: the front ends see it gone and end their open streams with an error event."""
        if self.sock is not None:  # with the front ends' copies closed too, new connections are refused
            self.sock.close()
        if core_first:
            self._stop_core()
        for proc in self.frontends:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.options.shutdown_timeout_s + 10
        for proc in self.frontends:
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                logger.warning("deltaserve serve: %s did not stop in time; killing it", proc.name)
                proc.kill()
                proc.join(5)
        self._stop_core()
        shutil.rmtree(self.workdir, ignore_errors=True)
        logger.info("deltaserve serve: stopped")

    def _stop_core(self) -> None:
        if self.core is not None and self.core.is_alive():
            os.kill(self.core.pid, signal.SIGTERM)
            self.core.join(30)
            if self.core.is_alive():
                logger.warning("deltaserve serve: the engine core did not stop in time; killing it")
                self.core.kill()
                self.core.join(5)


def _describe_exit(exitcode: int) -> str:
    """How a child that is no longer alive ended."""
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    if exitcode == EXIT_ENGINE_GONE:
        return f"exit code {exitcode} (it lost the engine core or the launcher)"
    return f"exit code {exitcode}"


def serve(engine_config: EngineConfig, options: ServeOptions) -> int:
    return Server(engine_config, options).run()
