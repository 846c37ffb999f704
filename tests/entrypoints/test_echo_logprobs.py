"""echo with logprobs on /v1/completions (lm-eval's loglikelihood requests): the prompt's tokens and
their prompt logprobs before the completion's, streamed and not; max_tokens=0 for the prompt alone;
vLLM's prompt_logprobs parameter. The values equal `LLM.generate`'s prompt logprobs."""

from __future__ import annotations

import json
import math

import pytest

from deltaserve import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, and then it ran far away"
K = 2


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    """The offline engine's prompt logprobs and greedy continuation of PROMPT (the server's model)."""
    llm = LLM(model="random:tiny", max_model_len=1024, cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    return llm.generate(PROMPT, params, use_tqdm=False)[0]


def _post(http, **body) -> dict:
    response = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _events(http, **body) -> list[dict]:
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": True, **body}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _assert_prompt_part(logprobs: dict, reference) -> None:
    """The first len(prompt) entries are the prompt's: no logprob for the first token, then the
    engine's prompt logprobs, with the top-K (keyed by text) beside each."""
    prompt_ids, expected = reference.prompt_token_ids, reference.prompt_logprobs
    n = len(prompt_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, n):
        want = expected[i][prompt_ids[i]]
        assert math.isclose(logprobs["token_logprobs"][i], want.logprob, abs_tol=1e-5), i
        assert logprobs["tokens"][i] == want.decoded_token
        top = logprobs["top_logprobs"][i]
        assert 1 <= len(top) <= K + 1 and max(top.values()) <= 0.0
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"],
                                                                     strict=False))


def test_echo_with_logprobs_puts_the_prompt_first(http, reference):
    body = _post(http, echo=True, logprobs=K, max_tokens=4)
    choice = body["choices"][0]
    n = len(reference.prompt_token_ids)
    assert choice["text"] == PROMPT + reference.outputs[0].text
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == n + 4
    _assert_prompt_part(logprobs, reference)
    completion = reference.outputs[0]
    for got, entry, t in zip(logprobs["token_logprobs"][n:], completion.logprobs, completion.token_ids, strict=True):
        assert math.isclose(got, entry[t].logprob, abs_tol=1e-5)
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == n
    # vLLM's choice.prompt_logprobs comes with it: {token id: {logprob, rank, decoded_token}}
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == n
    second = choice["prompt_logprobs"][1][str(reference.prompt_token_ids[1])]
    assert math.isclose(second["logprob"], logprobs["token_logprobs"][1], abs_tol=1e-6) and second["rank"] >= 1


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(http, reference):
    n = len(reference.prompt_token_ids)
    body = _post(http, echo=True, logprobs=K, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == n
    _assert_prompt_part(choice["logprobs"], reference)
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    plain = _post(http, echo=True, max_tokens=0, return_token_ids=True)["choices"][0]  # no logprobs asked
    assert plain["text"] == PROMPT and plain["logprobs"] is None and plain["token_ids"] == []
    assert plain["prompt_logprobs"] is None


def test_streamed_echo_carries_the_prompt_logprobs_in_the_first_chunk(http, reference):
    whole = _post(http, echo=True, logprobs=K, max_tokens=4)["choices"][0]
    events = _events(http, echo=True, logprobs=K, max_tokens=4, stream_options={"include_usage": True})
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    n = len(reference.prompt_token_ids)
    assert len(chunks[0]["logprobs"]["tokens"]) >= n
    merged = {key: [v for c in chunks for v in c["logprobs"][key]] for key in whole["logprobs"]}
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"][0] is None
    assert merged["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-6)
    assert events[-1]["usage"]["completion_tokens"] == 4

    only = _events(http, echo=True, logprobs=K, max_tokens=0, stream_options={"include_usage": True})
    chunks = [e["choices"][0] for e in only if e["choices"]]
    assert [c["text"] for c in chunks] == [PROMPT] and chunks[0]["finish_reason"] == "length"
    _assert_prompt_part(chunks[0]["logprobs"], reference)
    assert len(chunks[0]["logprobs"]["tokens"]) == n
    assert only[-1]["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_parameter(http, reference):
    choice = _post(http, prompt_logprobs=K, max_tokens=2)["choices"][0]
    assert choice["logprobs"] is None
    got, expected = choice["prompt_logprobs"], reference.prompt_logprobs
    assert got[0] is None and len(got) == len(expected)
    for entry, want in zip(got[1:], expected[1:], strict=True):
        assert set(entry) == {str(t) for t in want}
        for t, lp in want.items():
            assert math.isclose(entry[str(t)]["logprob"], lp.logprob, abs_tol=1e-5)
            assert entry[str(t)]["rank"] == lp.rank and entry[str(t)]["decoded_token"] == lp.decoded_token


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),  # without echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 3, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
])
def test_bad_echo_and_prompt_logprobs_requests(http, body, param):
    response = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
