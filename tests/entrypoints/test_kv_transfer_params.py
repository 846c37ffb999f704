"""vLLM's `kv_transfer_params` through the HTTP API (P/D disaggregation), chat's `prompt_token_ids`
(a decode leg's prompt, never re-rendered) and `return_token_ids` on both endpoints.

No KV connector is configured here, so the engine takes the field and returns no params: the
response carries `kv_transfer_params: null`. The engine side is tested in tests/kv_transfer/.
"""

from __future__ import annotations

import json

import pytest

from deltaserve.engine.core import EngineCoreOutput
from deltaserve.engine.output_processor import OutputProcessor
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deltaserve.sampling_params import SamplingParams

PROMPT = [5, 300, 17, 257, 42, 511, 9, 100]
GREEDY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "hello there"}]}
ENDPOINTS = [("/v1/completions", {**GREEDY, "prompt": PROMPT}), ("/v1/chat/completions", CHAT)]


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _events(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_the_field_becomes_the_engines_extra_args():
    params = {"do_remote_decode": True}
    completion = CompletionRequest.model_validate({"prompt": "hi", "kv_transfer_params": params})
    chat = ChatCompletionRequest.model_validate({"messages": CHAT["messages"], "kv_transfer_params": params})
    for body in (completion, chat):
        assert body.to_sampling_params(4, 20).extra_args == {"kv_transfer_params": params}
    assert CompletionRequest.model_validate({"prompt": "hi"}).to_sampling_params(4, 20).extra_args is None


def test_the_engines_params_reach_the_finished_output_only():
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("r", None, [1, 2], SamplingParams(max_tokens=2, detokenize=False))
    running, _ = processor.process([EngineCoreOutput("r", [7])])
    params = {"remote_engine_id": "p0", "remote_block_ids": [3]}
    finished, _ = processor.process([EngineCoreOutput("r", [8], finish_reason="length", kv_transfer_params=params)])
    assert running[0].kv_transfer_params is None
    assert finished[0].finished and finished[0].kv_transfer_params == params


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_requests_with_the_field_answer_null_params(http, path, body):
    plain = http.post(path, json=body).json()
    for params in ({}, {"do_remote_decode": True}, None):
        response = http.post(path, json={**body, "kv_transfer_params": params})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert "kv_transfer_params" in answer and answer["kv_transfer_params"] is None
        assert answer["choices"] == plain["choices"]


@pytest.mark.parametrize("path,body", ENDPOINTS)
@pytest.mark.parametrize("value", ["x", 3, [1], True])
def test_a_non_object_is_a_400_naming_the_field(http, path, body, value):
    response = http.post(path, json={**body, "kv_transfer_params": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert error["message"].startswith("kv_transfer_params must be an object or null")


def test_streams_send_the_field_on_the_last_chunk_only(http):
    events = _events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "kv_transfer_params": {}})
    assert all("kv_transfer_params" not in e for e in events)  # null: left out of every chunk
    chat = _events(http, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert all("kv_transfer_params" not in e for e in chat)
    assert all("token_ids" not in c for e in chat for c in e["choices"])  # only with return_token_ids


def test_chat_with_prompt_token_ids_matches_completions_on_the_same_ids(http):
    completion = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "return_token_ids": True}).json()
    chat = http.post("/v1/chat/completions", json={**CHAT, "prompt_token_ids": PROMPT, "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    choice, expected = chat.json()["choices"][0], completion["choices"][0]
    assert choice["prompt_token_ids"] == expected["prompt_token_ids"] == PROMPT
    assert choice["token_ids"] == expected["token_ids"] and len(expected["token_ids"]) == 8
    assert choice["message"]["content"] == expected["text"]
    assert chat.json()["usage"]["prompt_tokens"] == len(PROMPT)


def test_chat_returns_its_rendered_prompt_ids_which_replay_the_same_answer(http):
    rendered = http.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()["choices"][0]
    assert rendered["prompt_token_ids"] and rendered["token_ids"]
    replay = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "ignored"}],
                                                     "prompt_token_ids": rendered["prompt_token_ids"],
                                                     "return_token_ids": True}).json()["choices"][0]
    assert replay["token_ids"] == rendered["token_ids"]
    assert replay["message"] == rendered["message"]
    plain = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_chat_streams_token_ids_with_return_token_ids(http):
    whole = http.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()["choices"][0]
    chunks = [c for e in _events(http, "/v1/chat/completions", {**CHAT, "return_token_ids": True})
              for c in e["choices"]]
    assert [t for c in chunks for t in (c["token_ids"] or [])] == whole["token_ids"]
    assert [c["prompt_token_ids"] for c in chunks if c["prompt_token_ids"]] == [whole["prompt_token_ids"]]


@pytest.mark.parametrize("ids,message", [([], "must not be an empty list"), ([1, -2], "greater than or equal"),
                                         ("1 2", "list")])
def test_bad_chat_prompt_token_ids_are_a_400(http, ids, message):
    response = http.post("/v1/chat/completions", json={**CHAT, "prompt_token_ids": ids})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("prompt_token_ids") and message in error["message"]


def test_out_of_vocabulary_chat_prompt_ids_name_the_field(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "prompt_token_ids": [1, 10**6]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt_token_ids"
