"""`deltaserve serve --speculative-config`: n-gram speculation behind the OpenAI server gives the tokens
of an engine without it, streamed or not, and /metrics counts the drafts."""

from __future__ import annotations

import json
import random

from deltaserve import LLM, SamplingParams
from entrypoints.server import RemoteServer, scrape

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})


def test_speculative_serving_is_lossless(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path_factory.getbasetemp() / "ds-cache"))
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 500) for _ in range(12)] * 3 for _ in range(3)]
    reference = LLM(model="random:tiny", dtype="float32", device="cpu", cache_memory="64MiB", max_model_len=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [list(o.outputs[0].token_ids)
            for o in reference.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    with RemoteServer("--dtype", "float32", "--device", "cpu", "--speculative-config", SPEC) as server, \
            server.client(timeout=120) as client:
        got = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["token_ids"])
        streamed = []
        body = {"prompt": prompts[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0].get("token_ids") or []
        metrics = scrape(client)
    assert got == want
    assert streamed == want[0]
    assert metrics["deltaserve:spec_decode_num_drafts_total"] > 0
