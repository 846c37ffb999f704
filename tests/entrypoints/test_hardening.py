"""What a hostile or careless client can do to a running server: each finding of the hardening review.

Bounded work per request (huge prompts, request chat templates), 4xx rather than 5xx for bad input,
no Nagle delay on kept-alive connections, a header-read timeout, and a /health that a busy server
passes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from entrypoints.server import RemoteServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _rss_kib(pid: int, field: str = "VmHWM") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


# Bounded work -----------------------------------------------------------------------------------
def test_20_mib_prompt_is_refused_fast_without_tokenizing(two_frontend_server: RemoteServer):
    _, frontends = two_frontend_server.pids
    peak_before = {pid: _rss_kib(pid) for pid in frontends}
    prompt = "lorem ipsum dolor sit amet " * (20 * 2**20 // 27)
    with two_frontend_server.client() as client:
        started = time.monotonic()
        error = _error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400)
        elapsed = time.monotonic() - started
        assert error["param"] == "prompt" and "cannot fit in max_model_len=1024" in error["message"]
        assert elapsed < 2.0
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        error = _error(client.post("/v1/chat/completions", json=chat), 400)
        assert error["param"] == "messages" and "cannot fit" in error["message"]
    grown_mib = max(_rss_kib(pid) - peak_before[pid] for pid in frontends) / 1024
    assert grown_mib < 400, f"a front end's peak RSS grew by {grown_mib:.0f} MiB"  # tokenizing it took ~3 GB


def test_token_id_prompt_longer_than_the_context_is_refused(http):
    error = _error(http.post("/v1/completions", json={"prompt": [1] * 50_000, "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and "50000 tokens" in error["message"]


@pytest.mark.parametrize("body", [
    {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' * 100000000 }}"}},
    {**CHAT, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
])
def test_request_chat_templates_are_refused(http, body):
    started = time.monotonic()
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    assert time.monotonic() - started < 2.0


def test_chat_template_kwargs_cannot_override_the_servers_arguments(http):
    error = _error(http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"tokenize": True}}), 400)
    assert error["param"] == "chat_template_kwargs" and "tokenize" in error["message"]
    ok = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


# 4xx, never 5xx -------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": None, "min_tokens": 5000}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": None, "min_tokens": 5000}),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT["messages"], "min_tokens": 1020}),  # room: ~1000
])
def test_min_tokens_beyond_the_derived_max_tokens_is_400(http, path, body):
    error = _error(http.post(path, json=body), 400)
    assert error["param"] == "min_tokens" and "max_model_len=1024" in error["message"]


@pytest.mark.parametrize("header", [b"Bearer \xe9t\xe9", b"Bearer sk-\xff\xfe", "Bearer ключ".encode()])
def test_non_ascii_credentials_are_401(two_frontend_server: RemoteServer, header):
    with httpx.Client(base_url=two_frontend_server.url, timeout=30) as anonymous:
        response = anonymous.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                  headers=[(b"Authorization", header)])
        assert _error(response, 401)["code"] == "invalid_api_key"


def _raw_request(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_non_numeric_content_length_gets_an_openai_json_400(server: RemoteServer):
    reply = _raw_request(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: abc\r\n\r\n{}")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


# Connections ----------------------------------------------------------------------------------
def test_partial_headers_are_cut_after_the_header_timeout(server: RemoteServer):
    """The session server runs with --header-timeout 2: a client that never finishes its headers
    is disconnected, while one that does is served."""
    sockets = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
    try:
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.monotonic()
        for sock in sockets:
            assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 6.0
    finally:
        for sock in sockets:
            sock.close()
    assert _raw_request(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 200")


def test_kept_alive_connections_are_as_fast_as_fresh_ones(server: RemoteServer):
    """TCP_NODELAY on accepted sockets: without it a kept-alive connection waited ~40 ms per response.
    Fresh and kept-alive requests alternate, so whatever else loads the machine slows both alike."""
    def timed(client: httpx.Client, method: str, path: str, body: dict | None) -> float:
        started = time.perf_counter()
        assert client.request(method, path, json=body).status_code == 200
        return time.perf_counter() - started

    for method, path, body in (("GET", "/version", None),
                               ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})):
        fresh, kept = [], []
        with httpx.Client(base_url=server.url, timeout=30) as shared:
            timed(shared, method, path, body)  # connect once
            for _ in range(15):
                with httpx.Client(base_url=server.url, timeout=30) as once:
                    fresh.append(timed(once, method, path, body))
                kept.append(timed(shared, method, path, body))
        fresh_s, kept_s = statistics.median(fresh), statistics.median(kept)
        assert kept_s < 2 * fresh_s + 0.005, f"{path}: kept-alive {kept_s * 1e3:.1f} ms vs fresh {fresh_s * 1e3:.1f} ms"


def test_docs_are_served_only_without_an_api_key(server: RemoteServer, two_frontend_server: RemoteServer):
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200
        assert httpx.get(two_frontend_server.url + path, timeout=10).status_code == 404
    for path in ("/health", "/ping", "/version"):  # probes need no key
        assert httpx.get(two_frontend_server.url + path, timeout=10).status_code == 200
    assert httpx.post(two_frontend_server.url + "/ping", timeout=10).status_code == 200


# Health ---------------------------------------------------------------------------------------
def test_health_stays_200_during_a_long_prefill_burst(server: RemoteServer):
    """/health answers from the core's heartbeat: it no longer waits behind the engine's steps (on this
    CPU a step of these prefills takes seconds; a ping through the engine loop took as long)."""
    probes: list[tuple[int, float]] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                status = client.get("/health").status_code
                probes.append((status, time.perf_counter() - started))
                time.sleep(0.05)

    async def burst() -> None:
        prompts = [[(7 * i + j) % 500 + 1 for j in range(900)] for i in range(8)]  # 8 x 900 tokens, no shared prefix
        async with server.async_client(timeout=300, limits=httpx.Limits(max_connections=8)) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": p, "max_tokens": 4})
                                             for p in prompts))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        asyncio.run(burst())
    finally:
        stop.set()
        thread.join()
    assert probes and all(status == 200 for status, _ in probes), probes
    assert max(latency for _, latency in probes) < 1.0, sorted(latency for _, latency in probes)[-5:]
