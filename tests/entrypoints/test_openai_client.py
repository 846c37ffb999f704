"""The official `openai` client against a real server: both endpoints, streaming, usage, logprobs,
and greedy output equal to `LLM.generate`'s."""

from __future__ import annotations

import math

import openai
import pytest

from deltaserve import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return LLM(model="random:tiny", max_model_len=1024, cache_memory="64MiB")


def test_models_lists_every_served_name(client):
    names = [m.id for m in client.models.list().data]
    assert names == ["tiny", "tiny-alias"]


def test_greedy_completions_equal_llm_generate(client, offline):
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, logprobs=3), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
        choice = got.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == "length"
        ref_lps = [entry[t].logprob for entry, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids,
                                                         strict=True)]
        assert len(choice.logprobs.token_logprobs) == 12
        for a, b in zip(choice.logprobs.token_logprobs, ref_lps, strict=True):
            assert math.isclose(a, b, abs_tol=1e-5)
        # keyed by text, so ids that decode alike (partial UTF-8 shows as U+FFFD) share one entry
        assert all(1 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
        assert choice.logprobs.text_offset[0] == 0
        assert got.usage.completion_tokens == 12
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_token_id_prompts_and_batches(client, offline):
    ids = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33]]
    expected = offline.generate([{"prompt_token_ids": p} for p in ids],
                                SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [r.outputs[0].text for r in expected]
    single = client.completions.create(model="tiny", prompt=ids[0], max_tokens=6, temperature=0)
    assert single.choices[0].text == expected[0].outputs[0].text


def test_streaming_completion_concatenates_to_the_full_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "A long shared system prompt that is repeated verbatim. " * 8
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].text == first.choices[0].text


def test_chat_completion_uses_the_template_and_matches_generate(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    prompt = offline.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == 10


def test_chat_streaming_and_logprobs(client):
    messages = [{"role": "user", "content": "Count to three"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == 8
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob <= 0 for t in content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    streamed_lps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]
    assert streamed_lps == pytest.approx([t.logprob for t in content], abs=1e-6)
    assert chunks[-1].usage.completion_tokens == 8


def test_n_seed_and_stop(client):
    got = client.completions.create(model="tiny", prompt="Seeded", max_tokens=8, temperature=1.0, n=3, seed=7)
    again = client.completions.create(model="tiny", prompt="Seeded", max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [c.text for c in again.choices]
    assert len({c.text for c in got.choices}) > 1  # each sample has its own seed
    assert got.usage.completion_tokens == 24
    base = client.completions.create(model="tiny", prompt="Stop here", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model="tiny", prompt="Stop here", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_vllm_extras_are_accepted(client):
    got = client.completions.create(
        model="tiny-alias", prompt="Extras", max_tokens=5, temperature=0.8,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "min_tokens": 5},
    )
    assert got.model == "tiny-alias"
    assert got.usage.completion_tokens == 5
