"""kill -9 of each process of a server with streams open; request chat templates on a server that trusts them.

Each test starts its own server (its own process group, stopped by the test whatever happens): every
open stream must end with an error event and [DONE] within 5 s, the port must be released, and the
launcher's exit code must name what died.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from entrypoints.server import RemoteServer

LONG = {"prompt": "Keep going", "max_tokens": 900, "ignore_eos": True, "stream": True}
EXIT_ENGINE_CORE_DIED, EXIT_API_SERVER_DIED = 3, 4


@dataclass
class StreamResult:
    tokens: int = 0
    error: dict | None = None
    done: bool = False
    failure: Exception | None = None  # the connection broke (its front end was killed)
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)


class OpenStreams:
    """`count` long streamed completions, each read by a thread of its own."""

    def __init__(self, server: RemoteServer, count: int) -> None:
        self.server = server
        self.results = [StreamResult() for _ in range(count)]
        self.threads = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in self.results]

    def __enter__(self) -> OpenStreams:
        for thread in self.threads:
            thread.start()
        for result in self.results:
            assert result.started.wait(60), "a stream never produced a token"
        return self

    def __exit__(self, *exc) -> None:
        for thread in self.threads:
            thread.join(30)

    def _read(self, result: StreamResult) -> None:
        try:
            with httpx.Client(base_url=self.server.url, headers=self.server.headers, timeout=60) as client:
                with client.stream("POST", "/v1/completions", json=LONG) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            result.done = True
                            continue
                        chunk = json.loads(data)
                        if "error" in chunk:
                            result.error = chunk["error"]
                        else:
                            result.tokens += 1
                            result.started.set()
        except httpx.HTTPError as e:
            result.failure = e
        finally:
            result.ended_at = time.monotonic()
            result.started.set()

    def wait(self, timeout_s: float) -> list[StreamResult]:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0))
        return self.results


def _ended_with_error_event(result: StreamResult, since: float, within_s: float = 5.0) -> None:
    assert result.ended_at is not None and result.ended_at - since < within_s, "the stream hung"
    assert result.failure is None, result.failure
    assert result.error is not None and result.error["type"] == "service_unavailable", result
    assert result.done


def _port_released(port: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                return True
            except OSError:
                time.sleep(0.2)
    return False


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not _gone(p)]


def test_kill_9_of_the_engine_core():
    with RemoteServer() as server:
        core, frontends = server.pids
        with OpenStreams(server, 3) as streams:
            os.kill(core, signal.SIGKILL)
            killed_at = time.monotonic()
            for result in streams.wait(10):
                _ended_with_error_event(result, killed_at)
            assert "engine core" in streams.results[0].error["message"]
        assert server.proc.wait(30) == EXIT_ENGINE_CORE_DIED
        assert f"the engine core (pid {core}) died: killed by SIGKILL" in server.log
        assert _port_released(server.port)
        assert _wait_gone(frontends) == []


def test_kill_9_of_the_launcher():
    with RemoteServer() as server:
        core, frontends = server.pids
        with OpenStreams(server, 3) as streams:
            os.kill(server.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            server.proc.wait(10)
            for result in streams.wait(10):
                _ended_with_error_event(result, killed_at)
            assert "launcher" in streams.results[0].error["message"]
        assert _port_released(server.port)
        assert _wait_gone([core, *frontends]) == []  # nothing is left orphaned


def test_kill_9_of_one_front_end():
    with RemoteServer("--api-server-count", "2") as server:
        _, (first, second) = server.pids
        with OpenStreams(server, 6) as streams:
            os.kill(first, signal.SIGKILL)
            killed_at = time.monotonic()
            for result in streams.wait(10):
                if result.failure is None:  # served by the other front end: told why it ended
                    _ended_with_error_event(result, killed_at)
                else:  # the killed front end's own streams just break
                    assert result.ended_at is not None and result.ended_at - killed_at < 5.0
        assert server.proc.wait(30) == EXIT_API_SERVER_DIED
        assert f"deltaserve-api-server-0 (pid {first}) died: killed by SIGKILL" in server.log
        assert _port_released(server.port)
        assert _wait_gone([second]) == []


@pytest.fixture(scope="module")
def trusting_server():
    """A server that accepts request chat templates, with a 1 s limit on rendering one."""
    with RemoteServer("--trust-request-chat-template", "--cpu-work-timeout", "1") as server:
        yield server


def test_trusted_request_templates_render_off_the_event_loop_with_a_time_limit(trusting_server: RemoteServer):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with trusting_server.client() as client:
        ok = client.post("/v1/chat/completions", json={**chat, "chat_template": "Q: {{ messages[0].content }} A:"})
        assert ok.status_code == 200, ok.text
        slow = "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}x"
        result: dict = {}

        def render_slowly() -> None:
            with trusting_server.client() as other:
                started = time.monotonic()
                result["response"] = other.post("/v1/chat/completions", json={**chat, "chat_template": slow})
                result["elapsed"] = time.monotonic() - started

        thread = threading.Thread(target=render_slowly)
        thread.start()
        time.sleep(0.3)
        started = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - started < 0.5  # the event loop is free while the template renders
        thread.join(30)
        error = result["response"].json()["error"]
        assert result["response"].status_code == 400 and "1 s limit" in error["message"], error
        assert result["elapsed"] < 3.0
