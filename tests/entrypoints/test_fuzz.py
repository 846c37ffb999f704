"""Schemathesis fuzzes the live server from its own OpenAPI schema: no request may get a 5xx, hang or a bad error.

Cases come from schemathesis's strategies (`operation.as_strategy`), driven by a `@given` built inside each
test, because the schema URL is known only once the session's `server` fixture is up. Every operation gets
schema-valid cases; the POST endpoints also get negative ones (bodies that break the schema), and two thirds
of their valid cases are nudged to what the server serves (no unsupported fields, a served model), plain or
streamed, so the engine runs them too. Requests stay cheap for the tiny CPU model: token caps, n and the
number of prompts are clamped before sending. Afterwards the server must still serve and be idle.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.case import Case
from schemathesis.specs.openapi.schemas import OpenApiSchema

from entrypoints.server import RemoteServer, scrape

TIMEOUT_S = 30.0  # any request slower than this counts as a hang
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "best_of": 2}
MAX_PROMPTS = 4
VOCAB_SIZE = 512  # the tiny model's; servable cases keep token ids inside it
POST_EXAMPLES = 50
GET_EXAMPLES = 5

POSTS = ["/v1/completions", "/v1/chat/completions"]
GETS = ["/health", "/ping", "/version", "/metrics", "/v1/models"]
# fields the server accepts only at a neutral value ("not supported yet"); servable cases leave them out
UNSUPPORTED = ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "suffix", "best_of",
               "tools", "tool_choice", "response_format"]
INT_FIELDS = ["max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens", "logprobs", "top_logprobs"]


@pytest.fixture(scope="module")
def schema(server: RemoteServer) -> OpenApiSchema:
    """The server's own schema, loaded from its URL; an empty config so no schemathesis.toml is picked up."""
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=SchemathesisConfig())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cheapen(body: Any, path: str) -> None:
    """Clamp what makes a request expensive, in place; a number keeps its type, so an invalid one stays invalid."""
    if not isinstance(body, dict):
        return
    for key, cap in CAPS.items():
        if _is_number(body.get(key)) and body[key] > cap:
            body[key] = type(body[key])(cap)
    # a missing or null cap means up to the context length (chat) or 16 tokens (completions)
    keys = ("max_tokens", "max_completion_tokens") if path == "/v1/chat/completions" else ("max_tokens",)
    if all(body.get(key) is None for key in keys):
        body[keys[-1]] = CAPS["max_tokens"]
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]


def _servable(body: dict[str, Any], stream: bool) -> None:
    """Turn a cheapened schema-valid body into one the server serves, in place, so the engine runs it."""
    for key in UNSUPPORTED:
        body.pop(key, None)
    for key in INT_FIELDS:  # JSON Schema takes 3.0 as an integer; the server is strict
        if isinstance(body.get(key), float) and body[key].is_integer():
            body[key] = int(body[key])
    body["model"] = "tiny"
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)
    for message in body.get("messages", []):
        if not message.get("content") and message.get("role") != "assistant":
            message["content"] = "hi"
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
    if not body.get("logprobs"):
        body.pop("top_logprobs", None)
    if body.get("max_completion_tokens") is not None:
        body.pop("max_tokens", None)
    body["min_tokens"] = min(body.get("min_tokens", 0), body.get("max_completion_tokens") or body["max_tokens"])
    if body.get("stop_token_ids"):
        body["stop_token_ids"] = _token_ids(body["stop_token_ids"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and _is_number(prompt[0]):
        body["prompt"] = _token_ids(prompt)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = [_token_ids(ids) or [1] for ids in prompt]


def _token_ids(ids: list[int | float]) -> list[int]:
    """Schema-valid token ids (ints or integral floats, any size) as ids the tiny model has."""
    return [int(t) % VOCAB_SIZE for t in ids]


def _check_error_body(response: requests.Response | httpx.Response, where: str) -> None:
    """OpenAI's shape: {"error": {"message": non-empty string, "type": string, ...}}."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        pytest.fail(f"4xx without OpenAI's error body: {where}")
    assert isinstance(error.get("message"), str) and error["message"], where
    assert isinstance(error.get("type"), str), where


def _check(response: requests.Response, elapsed_s: float, case: Case) -> None:
    """No 5xx, no hang, OpenAI's error body on every 4xx, and streams that run to [DONE]."""
    sent = json.dumps(case.body, default=repr)[:2000] if case.body is not None else None
    where = f"{case.method} {case.path} body={sent} -> {response.status_code} {response.text[:500]!r}"
    assert response.status_code < 500, where
    assert elapsed_s < TIMEOUT_S, f"took {elapsed_s:.1f}s: {where}"
    if 400 <= response.status_code < 500:
        _check_error_body(response, where)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200, where
        lines = re.split(r"\r\n|\r|\n", response.text)  # SSE's line ends only: str.splitlines() also splits at \x85
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {where}"
        for event in events[:-1]:
            try:
                chunk = json.loads(event)
            except ValueError:
                pytest.fail(f"stream event is not JSON: {event[:200]!r}: {where}")
            if "error" in chunk:  # an error after the 200 went out comes as one event before [DONE]
                assert isinstance(chunk["error"].get("message"), str) and chunk["error"]["message"], where


def _fuzz(schema: OpenApiSchema, server: RemoteServer, path: str, method: str, mode: GenerationMode,
          max_examples: int) -> None:
    """Run `max_examples` cases of one operation in one generation mode against the server."""
    cases = schema[path][method].as_strategy(generation_mode=mode)
    # valid cases of a POST go out as generated, or made servable and sent plain or streamed
    nudges = [None, "plain", "stream"] if mode is GenerationMode.POSITIVE and method == "POST" else [None]

    # the health checks left out judge how fast and how big generation is, which is the schema's, not the server's
    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases, nudge=st.sampled_from(nudges))
    def run(case: Case, nudge: str | None) -> None:
        _cheapen(case.body, path)
        if nudge is not None and isinstance(case.body, dict):
            _servable(case.body, stream=nudge == "stream")
        kwargs = case.as_transport_kwargs(base_url=server.url, headers=server.headers)
        start = time.monotonic()
        try:  # a connection per request: the server drops the one a 500 went out on, and shrinking goes on
            response = requests.request(**kwargs, timeout=TIMEOUT_S)
        except requests.RequestException as e:  # a timeout (a hang) or a dropped connection (a crash)
            pytest.fail(f"no answer ({e!r}): {case.method} {case.path} body={case.body!r}"[:3000])
        _check(response, time.monotonic() - start, case)

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("path", POSTS)
def test_fuzz_post(schema: OpenApiSchema, server: RemoteServer, path: str, mode: GenerationMode) -> None:
    _fuzz(schema, server, path, "POST", mode, POST_EXAMPLES)


@pytest.mark.parametrize("path", GETS)
def test_fuzz_get(schema: OpenApiSchema, server: RemoteServer, path: str) -> None:
    # these take no parameters, so there is nothing to break: schema-valid cases only
    _fuzz(schema, server, path, "GET", GenerationMode.POSITIVE, GET_EXAMPLES)


# "\ud800" is a legal JSON escape but no text (a lone UTF-16 surrogate); schemathesis never generates one
SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_completion_tokens": 2}'),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
]


@pytest.mark.parametrize("path,body", SURROGATE_BODIES)
def test_lone_surrogate_is_bad_input(server: RemoteServer, path: str, body: str) -> None:
    with server.client() as client:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    where = f"POST {path} body={body} -> {response.status_code} {response.text[:300]!r}"
    assert 400 <= response.status_code < 500, where
    _check_error_body(response, where)


def test_server_survives_fuzzing(server: RemoteServer) -> None:
    """Runs last in this file: the server still serves and has no request left running."""
    with server.client() as client:
        assert client.get("/health").status_code == 200
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
        deadline = time.monotonic() + 5
        while (running := scrape(client).get("deltaserve:num_requests_running")) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running == 0, f"deltaserve:num_requests_running={running} after the fuzz run"
