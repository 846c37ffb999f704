"""`deltaserve proxy` (P/D disaggregation): fake prefill and decode backends that record what they
were sent, each on uvicorn in a thread on loopback. Real servers behind the proxy: test_pd_serve.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deltaserve.cli import build_parser
from deltaserve.entrypoints.proxy import ProxyOptions, build_proxy_app
from entrypoints.server import ThreadedServer, scrape

PREFILL_IDS = [11, 12, 13, 14]


class FakeBackend:
    """A deltaserve stand-in: a prefill leg (kv_transfer_params.do_remote_decode, streamed) gets the
    prompt ids, one token and params naming this backend; with `chunked`, the params come in the
    first event, and the last waits for `prefill_gate`. A decode leg gets its text, streamed in two
    events (the second once `gate` is set). `status` makes it answer an error; `hold` delays every
    answer; `fail_prefill_stream` ends a prefill stream with an error event."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[dict[str, Any]] = []
        self.status: int | None = None
        self.chunked = False
        self.fail_prefill_stream = False
        self.prefill_gate = threading.Event()
        self.prefill_done = threading.Event()
        self.gate = threading.Event()
        self.hold = threading.Event()
        self.app = FastAPI()
        self.app.post("/v1/completions")(self._complete)
        self.app.post("/v1/chat/completions")(self._complete)
        self.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": self.name}]})
        self.app.get("/health")(lambda: {})

    def reset(self) -> None:
        self.received.clear()
        self.status = None
        self.chunked = self.fail_prefill_stream = False
        self.prefill_gate.set()
        self.prefill_done.clear()
        self.gate.clear()
        self.hold.set()

    @staticmethod
    async def _wait(event: threading.Event) -> None:
        deadline = time.monotonic() + 10
        while not event.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _complete(self, request: Request):
        body = await request.json()
        self.received.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        await self._wait(self.hold)
        if self.status is not None:
            error = {"message": f"max_tokens: {self.name} refuses", "type": "invalid_request_error",
                     "param": "max_tokens", "code": None}
            return JSONResponse({"error": error}, status_code=self.status)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return StreamingResponse(self._prefill_events(), media_type="text/event-stream")
        if not body.get("stream"):
            return {"choices": [{"index": 0, "text": f"from {self.name}"}], "kv_transfer_params": None}

        async def events():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'one'}]})}\n\n"
            await self._wait(self.gate)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'two'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _prefill_events(self):
        params = {"remote_engine_id": self.name, "remote_block_ids": [7]}
        first = {"choices": [{"index": 0, "text": "", "prompt_token_ids": PREFILL_IDS, "token_ids": []}]}
        if self.chunked:
            first["kv_transfer_params"] = {**params, "chunked": True}
        yield f"data: {json.dumps(first)}\n\n"
        await self._wait(self.prefill_gate)
        if self.fail_prefill_stream:
            yield f"data: {json.dumps({'error': {'message': 'the engine died', 'type': 'server_error'}})}\n\n"
        else:
            last = {"choices": [{"index": 0, "text": "x", "token_ids": [1], "finish_reason": "length"}],
                    "kv_transfer_params": params}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
        self.prefill_done.set()


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def fakes():
    backends = {name: FakeBackend(name) for name in ("p0", "p1", "d0", "d1")}
    servers = {name: ThreadedServer(b.app).__enter__() for name, b in backends.items()}
    for name, b in backends.items():
        b.url = servers[name].url
    try:
        yield backends
    finally:
        for s in servers.values():
            s.__exit__()


@pytest.fixture(autouse=True)
def _reset(request):
    if "fakes" in request.fixturenames:
        for b in request.getfixturevalue("fakes").values():
            b.reset()


def _proxy(fakes, prefill=("p0", "p1"), decode=("d0", "d1"), **kwargs) -> ThreadedServer:
    options = ProxyOptions([fakes[n].url if n in fakes else n for n in prefill],
                           [fakes[n].url for n in decode], **kwargs)
    return ThreadedServer(build_proxy_app(options))


@pytest.fixture(scope="module")
def proxy(fakes):
    with _proxy(fakes) as p:
        yield p


def _served(fakes, *names) -> list[dict]:
    return [r for n in names for r in fakes[n].received]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_legs_carry_the_right_fields(fakes, proxy, path):
    body = {"model": "m", "max_tokens": 20, "min_tokens": 3, "n": 2, "temperature": 0.5, "return_token_ids": False}
    body |= {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}],
                                                                    "max_completion_tokens": 20}
    response = httpx.post(proxy.url + path, json=body, headers={"Authorization": "Bearer client-key"})
    assert response.status_code == 200, response.text
    (prefill,), (decode,) = _served(fakes, "p0", "p1"), _served(fakes, "d0", "d1")
    assert prefill["path"] == decode["path"] == path
    leg = prefill["body"]
    assert leg["max_tokens"] == 1 and leg["stream"] is True and leg["return_token_ids"] is True
    assert leg["kv_transfer_params"] == {"do_remote_decode": True} and leg["n"] == 2 and "min_tokens" not in leg
    if path == "/v1/chat/completions":
        assert leg["max_completion_tokens"] == 1
    prefill_name = next(n for n in ("p0", "p1") if fakes[n].received)
    leg = decode["body"]
    assert leg["kv_transfer_params"] == {"remote_engine_id": prefill_name, "remote_block_ids": [7]}
    assert leg[("prompt" if path == "/v1/completions" else "prompt_token_ids")] == PREFILL_IDS
    assert {k: leg[k] for k in body if k != "prompt"} == {k: v for k, v in body.items() if k != "prompt"}
    assert prefill["headers"]["authorization"] == decode["headers"]["authorization"] == "Bearer client-key"
    assert prefill["headers"]["x-request-id"] == decode["headers"]["x-request-id"]
    assert response.json()["choices"][0]["text"].startswith("from d")


def test_stream_passes_through_chunk_by_chunk(fakes, proxy):
    body = {"prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len("data: "):])["choices"][0]["text"] == "one"
        assert not any(b.gate.is_set() for b in fakes.values())  # the backend has not sent the rest yet
        for b in fakes.values():
            b.gate.set()
        rest = [line for line in lines if line]
    assert [json.loads(line[6:])["choices"][0]["text"] for line in rest[:-1]] == ["two"]
    assert rest[-1] == "data: [DONE]"
    (prefill,), (decode,) = _served(fakes, "p0", "p1"), _served(fakes, "d0", "d1")
    assert prefill["body"]["stream"] is True and "stream_options" not in prefill["body"]
    assert decode["body"]["stream"] is True and decode["body"]["stream_options"] == {"include_usage": True}


def test_a_chunked_producer_starts_the_decode_leg_while_its_prefill_runs(fakes, proxy):
    for b in fakes.values():
        b.chunked = True
        b.prefill_gate.clear()  # the prefills send their params, then wait
    response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith("from d")
    (decode,) = _served(fakes, "d0", "d1")
    (prefill_name,) = [n for n in ("p0", "p1") if fakes[n].received]
    assert decode["body"]["kv_transfer_params"] == {"remote_engine_id": prefill_name, "remote_block_ids": [7],
                                                    "chunked": True}
    assert decode["body"]["prompt"] == PREFILL_IDS
    assert not fakes[prefill_name].prefill_done.is_set()  # answered before the prefill finished
    gauge = f"deltaserve_proxy_backend_in_flight{{backend={fakes[prefill_name].url},role=prefill}}"
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        assert scrape(client)[gauge] == 1  # the prefill leg is still read, in the background
        fakes[prefill_name].prefill_gate.set()
        assert fakes[prefill_name].prefill_done.wait(10)
        deadline = time.monotonic() + 10
        while scrape(client)[gauge] != 0:
            assert time.monotonic() < deadline, "the prefill leg was not read to its end"
            time.sleep(0.02)


def test_a_prefill_stream_ending_in_an_error_is_a_502(fakes, proxy):
    for b in fakes.values():
        b.fail_prefill_stream = True
    response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 502
    assert "prefill leg" in response.json()["error"]["message"] and "the engine died" in response.text
    assert not _served(fakes, "d0", "d1")


def test_a_client_leaving_before_its_body_arrived_is_counted_quietly(fakes, proxy):
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:  # half a body, then gone
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    series = "deltaserve_proxy_requests_total{endpoint=completions,outcome=cancelled}"
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        deadline = time.monotonic() + 10
        while scrape(client).get(series, 0) < 1:
            assert time.monotonic() < deadline, "the abandoned request was not counted"
            time.sleep(0.02)
    assert not _served(fakes, "p0", "p1", "d0", "d1")


def test_round_robin_alternates(fakes, proxy):
    for _ in range(4):
        assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert [len(fakes[n].received) for n in ("p0", "p1", "d0", "d1")] == [2, 2, 2, 2]


def test_least_loaded_picks_the_idle_backend(fakes):
    with _proxy(fakes, policy="least_loaded") as p, httpx.Client(base_url=p.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "a", "stream": True}) as held:
            lines = held.iter_lines()  # kept: dropping a half-read iterator closes the connection
            next(line for line in lines if line)  # a decode leg is open on one backend
            busy = next(n for n in ("d0", "d1") if fakes[n].received)
            idle = "d1" if busy == "d0" else "d0"
            for _ in range(3):
                assert client.post("/v1/completions", json={"prompt": "b"}).status_code == 200
            assert len(fakes[busy].received) == 1 and len(fakes[idle].received) == 3
            for b in fakes.values():
                b.gate.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"


def test_a_client_leaving_a_stream_closes_the_decode_leg(fakes, proxy):
    gauge = "deltaserve_proxy_backend_in_flight{{backend={},role=decode}}"
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "a", "stream": True}) as held:
            lines = held.iter_lines()
            next(line for line in lines if line)
            busy = next(n for n in ("d0", "d1") if fakes[n].received)
            assert scrape(client)[gauge.format(fakes[busy].url)] == 1
        deadline = time.monotonic() + 10  # the client is gone: the proxy closes the leg and counts it out
        while scrape(client)[gauge.format(fakes[busy].url)] != 0:
            assert time.monotonic() < deadline, "the decode leg stayed open after the client left"
            time.sleep(0.02)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failing_prefill_is_a_502_naming_the_leg(fakes, proxy, path):
    for b in fakes.values():
        b.status = 500
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(proxy.url + path, json=body)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["message"].startswith("prefill leg (http://127.0.0.1:") and "500" in error["message"]
    assert error["type"] == "server_error" and error["code"] == "prefill_failed"
    assert _served(fakes, "d0", "d1") == []


def test_an_unreachable_prefill_is_a_502_and_health_says_so(fakes):
    dead = _closed_port_url()
    with _proxy(fakes, prefill=(dead,)) as p:
        response = httpx.post(p.url + "/v1/completions", json={"prompt": "hi"})
        health = httpx.get(p.url + "/health")
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["message"].startswith(f"prefill leg ({dead}) is unreachable")
    assert error["code"] == "prefill_unreachable"
    assert health.status_code == 200
    reachable = {(b["role"], b["url"]): b["reachable"] for b in health.json()["backends"]}
    assert reachable == {("prefill", dead): False, ("decode", fakes["d0"].url): True,
                         ("decode", fakes["d1"].url): True}


def test_a_decode_400_reaches_the_client_as_400(fakes, proxy):
    for name in ("d0", "d1"):
        fakes[name].status = 400
    response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "stream": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith("decode leg (http://127.0.0.1:") and "refuses" in error["message"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("decode leg")


def test_the_proxys_own_400s_name_the_field(fakes, proxy):
    cases = [(b"{not json", None), (json.dumps({"prompt": ["a", "b"]}).encode(), "prompt"),
             (json.dumps({"prompt": "a", "kv_transfer_params": {}}).encode(), "kv_transfer_params")]
    for raw, param in cases:
        response = httpx.post(proxy.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert _served(fakes, "p0", "p1") == []


def test_models_health_and_metrics(fakes, proxy):
    assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert httpx.get(proxy.url + "/v1/models").json()["data"] == [{"id": "d0"}]
    health = httpx.get(proxy.url + "/health")
    assert health.status_code == 200 and all(b["healthy"] for b in health.json()["backends"])
    with httpx.Client(base_url=proxy.url) as client:
        values = scrape(client)
    assert values["deltaserve_proxy_requests_total{endpoint=completions,outcome=ok}"] >= 1
    assert values["deltaserve_proxy_leg_seconds_count{leg=prefill}"] >= 1
    assert values["deltaserve_proxy_leg_seconds_count{leg=decode}"] >= 1
    assert values[f"deltaserve_proxy_backend_in_flight{{backend={fakes['d0'].url},role=decode}}"] == 0


def test_api_keys(fakes):
    with _proxy(fakes, api_key="proxy-key", backend_api_key="backend-key") as p:
        assert httpx.post(p.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        wrong = httpx.post(p.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(p.url + "/v1/completions", json={"prompt": "hi"},
                        headers={"Authorization": "Bearer proxy-key"})
        assert ok.status_code == 200 and httpx.get(p.url + "/health").status_code == 200
    assert {r["headers"]["authorization"] for r in _served(fakes, "p0", "p1", "d0", "d1")} == {"Bearer backend-key"}


def test_the_command_line():
    args = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3",
                                      "--port", "9000", "--policy", "least_loaded", "--api-key", "k"])
    assert (args.prefill, args.decode, args.port, args.policy, args.api_key) == (
        ["http://a:1", "http://b:2"], ["http://c:3"], 9000, "least_loaded", "k")
    with pytest.raises(ValueError, match="--policy 'fastest'"):
        ProxyOptions(["http://a:1"], ["http://c:3"], policy="fastest").validate()
