"""`deltaserve serve`: start the engine-core process and N API front ends, supervise, shut down cleanly.

    launcher (this process: no model, no tokenizer)
      |- engine core process      ROUTER socket at ipc://<tmp>/core.sock, the model and caches
      |- API front end 0..N-1     uvicorn on one shared listening socket, DEALER to the core

The launcher binds the listening socket first (so a taken port fails at once, `--port 0` works, and
every front end accepts on the same port), starts the core and waits for its `CoreReady`, then
starts the front ends. SIGTERM or SIGINT: the front ends stop accepting and drain (open requests
finish, or are cancelled after `--shutdown-timeout`, which aborts them in the core); then the core
stops; exit 0. If any child dies on its own, everything stops and the exit code is 1.
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
from deltaserve.engine.core_proc import CoreReady, run_engine_core
from deltaserve.entrypoints.openai.api_server import DEFAULT_MAX_BODY_BYTES, FrontendSettings, run_api_server

logger = logging.getLogger("deltaserve.serve")


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

    def __post_init__(self) -> None:
        if not isinstance(self.api_server_count, int) or self.api_server_count < 1:
            raise ValueError(f"api_server_count={self.api_server_count!r} must be an integer >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout_s} must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes={self.max_body_bytes} must be at least 1024")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
            log_level=opts.log_level, max_model_len=ready.max_model_len,
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
            while not self._stop_requested:
                dead = [p for p in [self.core, *self.frontends] if p is not None and not p.is_alive()]
                if dead:
                    logger.error("deltaserve serve: %s exited unexpectedly (exit code %s); stopping",
                                 dead[0].name, dead[0].exitcode)
                    code = 1
                    break
                time.sleep(0.2)
        except (RuntimeError, ValueError) as e:
            logger.error("deltaserve serve: %s", e)
            code = 1
        finally:
            self.shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return code

    def _log_startup(self, ready: CoreReady) -> None:
        host, port = self.bound_address
        gib = ready.cache_bytes / 2**30
        logger.info(
            "deltaserve serve: model %s (served as %s) on %s %s; max_model_len %d; KV cache %d blocks x %d tokens, "
            "%d KDA state slots, %d checkpoint units x %d bytes (%.2f GiB in all); %d API server(s)",
            ready.model_dir, ", ".join(self.served_model_names),
            ready.device, ready.dtype, ready.max_model_len, ready.num_kv_blocks, ready.block_size,
            ready.num_state_slots, ready.num_checkpoint_units, ready.checkpoint_unit_bytes, gib,
            self.options.api_server_count,
        )
        logger.info("deltaserve serve: ready on http://%s:%d", host if ":" not in host else f"[{host}]", port)

    def shutdown(self) -> None:
        if self.sock is not None:  # with the front ends' copies closed too, new connections are refused
            self.sock.close()
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
        if self.core is not None and self.core.is_alive():
            os.kill(self.core.pid, signal.SIGTERM)
            self.core.join(30)
            if self.core.is_alive():
                logger.warning("deltaserve serve: the engine core did not stop in time; killing it")
                self.core.kill()
                self.core.join(5)
        shutil.rmtree(self.workdir, ignore_errors=True)
        logger.info("deltaserve serve: stopped")


def serve(engine_config: EngineConfig, options: ServeOptions) -> int:
    return Server(engine_config, options).run()
