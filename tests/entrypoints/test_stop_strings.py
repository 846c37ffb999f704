"""Stop strings through the server: streams hold back only a possible stop string's start, and bad ones are 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from deltaserve.sampling_params import MAX_STOP_STRING_CHARS

GREEDY = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
NEVER = "<" + "never " * 400 + ">"  # 2,402 characters the tiny model will not write


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=120) as client:
        yield client


def _stream(client: httpx.Client, body: dict) -> list[dict]:
    """The choices of each chunk of a streamed completion, in order."""
    choices = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices.extend(json.loads(line[len("data: "):])["choices"])
    return choices


def _complete(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_long_stop_string_does_not_hold_back_the_stream(http):
    body = {**GREEDY, "stop": [NEVER]}
    full = _complete(http, body)
    assert full["finish_reason"] == "length" and full["text"]
    choices = _stream(http, body)
    running = "".join(c["text"] for c in choices if c["finish_reason"] is None)
    assert running and full["text"].startswith(running)  # text came before the last chunk
    assert "".join(c["text"] for c in choices) == full["text"]


def test_streamed_text_is_cut_where_the_stop_string_starts(http):
    text = _complete(http, GREEDY)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    body = {**GREEDY, "stop": [NEVER, stop]}
    full = _complete(http, body)
    assert full["finish_reason"] == "stop" and full["text"] == text[: text.index(stop)]
    choices = _stream(http, body)
    assert "".join(c["text"] for c in choices) == full["text"]
    assert choices[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "stop, where, says",
    [
        ('["ok", "\\ud800"]', "stop[1]", "lone surrogate"),
        ('"a\\udc00"', "stop", "lone surrogate"),
        (json.dumps(["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop[0]", f"at most {MAX_STOP_STRING_CHARS} characters"),
    ],
)
def test_bad_stop_string_is_a_400_naming_it(http, stop, where, says):
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ' + stop + "}"
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop"
    assert error["message"].startswith(where) and says in error["message"]
