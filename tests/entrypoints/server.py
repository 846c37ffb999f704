"""A real `deltaserve serve` on loopback, started by a test: its own process tree, any free port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import uvicorn

_READY = re.compile(r"ready on (http://[^\s]+)")
_PIDS = re.compile(r"engine core pid (\d+); API server pids ([\d, ]+)")


class RemoteServer:
    """`deltaserve serve --port 0 ARGS...`; `url` once it answers /health.

    Without --model in ARGS it serves the random tiny preset (vocab 512) as "deltaserve-tiny" (or the
    --served-model-name in ARGS), whatever the default model is.
    """

    def __init__(self, *args: str, startup_timeout_s: float = 120.0, api_key: str | None = None) -> None:
        model = [] if "--model" in args else ["--model", "random:tiny"]
        if "--model" not in args and "--served-model-name" not in args:
            model += ["--served-model-name", "deltaserve-tiny"]
        self.args = ["--port", "0", "--cache-memory", "64MiB", "--max-model-len", "1024", "--log-stats-interval",
                     "1", *model, *args]
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.lines: list[str] = []
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def __enter__(self) -> RemoteServer:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(  # a process group of its own, so stop() can end every process in it
            [sys.executable, "-m", "deltaserve.cli", "serve", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._ready.wait(self.startup_timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.log)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server never became healthy:\n" + self.log)

    def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = _READY.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def pids(self) -> tuple[int, list[int]]:
        """(engine core pid, API server pids), as the launcher logged them."""
        match = _PIDS.search(self.log)
        assert match, self.log
        return int(match.group(1)), [int(p) for p in match.group(2).split(", ")]

    @property
    def port(self) -> int:
        assert self.url is not None
        return int(self.url.rsplit(":", 1)[1])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def async_client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 60),
                                 **kwargs)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as a process manager would; the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        """SIGTERM the launcher and wait; then SIGKILL whatever is left of its process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape(client: httpx.Client) -> dict[str, float]:
    """GET /metrics, parsed by prometheus_client: {sample name + labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


class ThreadedServer:
    """An ASGI app on uvicorn in a thread, on 127.0.0.1 and any free port; stopped on exit."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> ThreadedServer:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        assert self.thread is not None
        self.thread.join(10)
