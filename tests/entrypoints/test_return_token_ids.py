"""vLLM's `return_token_ids` on /v1/completions (what `deltaserve bench serve` appends to an agentic
context), and the vocabulary size in /v1/models (what it draws prompt ids from)."""

from __future__ import annotations

import json

PROMPT = [5, 300, 17, 257, 42, 511, 9, 100]  # ids, the special ones (256..258) among them


def _events(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_non_streamed_choice_carries_prompt_and_generated_ids(server):
    with server.client() as client:
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    assert len(choice["token_ids"]) == 12 and all(0 <= t < 512 for t in choice["token_ids"])
    assert choice["text"] == plain["text"]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_stream_sends_every_id_once_and_the_prompt_in_the_first_chunk(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with server.client() as client:
        whole = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
        events = _events(client, {**body, "return_token_ids": True, "stream_options": {"include_usage": True}})
        plain = _events(client, body)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert all(c["token_ids"] for c in chunks[:-1])  # a chunk per new id, even where the text is empty
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert events[-1]["usage"]["completion_tokens"] == 24
    assert all(e["choices"][0]["token_ids"] is None for e in plain if e["choices"])


def test_models_report_the_vocabulary_size(server):
    with server.client() as client:
        cards = client.get("/v1/models").json()["data"]
    assert {card["vocab_size"] for card in cards} == {512}
