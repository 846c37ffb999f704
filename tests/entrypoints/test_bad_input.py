"""Bad input gets the right status and OpenAI's error body naming the field, and never disturbs the server."""

from __future__ import annotations

import httpx
import pytest

from entrypoints.server import scrape

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


COMPLETION_CASES = [
    # (override, param the error names)
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": 2000}, "max_tokens"),  # prompt + max_tokens beyond max_model_len=1024
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 10**9}, "n"),
    ({"logprobs": 99}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**70}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [5000]}, "prompt"),  # outside the vocabulary
    ({"prompt": "x" * 3000}, "prompt"),  # longer than the context
    ({"prompt": None}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"cache_control": {"type": "ephemeral", "ttl": "1h"}}, "cache_control"),  # a TTL is not supported
]


@pytest.mark.parametrize("override,param", COMPLETION_CASES, ids=[str(c[0])[:40] for c in COMPLETION_CASES])
def test_bad_completion_fields(http, override, param):
    error = _error(http.post("/v1/completions", json={**COMPLETION, **override}), 400)
    assert error["param"] is not None and error["param"].split(".")[0].split("[")[0] == param, error
    assert error["type"] == "invalid_request_error"


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),  # longer than the context
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"unknown_field": True}, "unknown_field"),
    ({"cache_control": "ephemeral"}, "cache_control"),
]


@pytest.mark.parametrize("override,param", CHAT_CASES, ids=[str(c[0])[:40] for c in CHAT_CASES])
def test_bad_chat_fields(http, override, param):
    error = _error(http.post("/v1/chat/completions", json={**CHAT, **override}), 400)
    assert error["param"] is not None and error["param"].split(".")[0].split("[")[0] == param, error


def test_unknown_model_is_404_naming_model(http):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = _error(http.post(path, json={**body, "model": "gpt-17"}), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
        assert "gpt-17" in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b'{"prompt": "hi",}', b"", b"[1, 2, 3]", b'"just a string"',
                                 b'{"prompt": "\xff\xfe bad utf-8"}', b"\xc3\x28"])
def test_malformed_bodies_are_400(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _error(response, 400)


def test_huge_bodies_are_413(http):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (2 * 2**20) + b'"}'
    error = _error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert "limit" in error["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"a" * 2**16
        yield b'"}'

    _error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_unknown_routes_and_methods(http):
    assert _error(http.get("/v1/nope"), 404)["message"].startswith("Not found")
    _error(http.get("/v1/completions"), 405)
    _error(http.post("/v1/models"), 405)


def test_server_keeps_serving_after_bad_input(http):
    before = scrape(http)
    for override, _ in COMPLETION_CASES[:10]:
        http.post("/v1/completions", json={**COMPLETION, **override})
    ok = http.post("/v1/completions", json=COMPLETION)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    after = scrape(http)
    assert after["deltaserve:request_success_total{finished_reason=length}"] == (
        before.get("deltaserve:request_success_total{finished_reason=length}", 0) + 1
    )  # none of the bad requests reached the engine


def test_api_key_is_required_when_set(two_frontend_server):
    with httpx.Client(base_url=two_frontend_server.url, timeout=30) as anonymous:
        error = _error(anonymous.post("/v1/completions", json=COMPLETION), 401)
        assert error["code"] == "invalid_api_key"
        wrong = anonymous.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-wrong"})
        _error(wrong, 401)
        _error(anonymous.get("/v1/models"), 401)
        assert anonymous.get("/health").status_code == 200  # probes need no key
    with two_frontend_server.client() as client:
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # model left out: the default
        assert ok.status_code == 200 and ok.json()["model"] == "deltaserve-tiny"


def test_too_many_choices_in_one_request(http):
    error = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["a"] * 20, "n": 100}), 400)
    assert error["param"] == "prompt" and "2000 completions" in error["message"]
