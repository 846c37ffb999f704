"""`deltaserve serve` with the offload tier (host memory and disk): a conversation whose KDA state HBM
evicted comes back from the tier, with the tokens of an engine without prefix caching, and /metrics
counts the loads, the tier's share of the hit and each tier's hits."""

from __future__ import annotations

import random

from deltaserve import LLM, SamplingParams
from entrypoints.server import RemoteServer, scrape

TIER_FLAGS = ("--dtype", "float32", "--device", "cpu", "--kv-offloading-size", "64MiB", "--kv-offloading-chunk-size",
              "64", "--state-checkpoint-interval", "64", "--state-checkpoint-fraction", "0.0005")


def test_a_conversation_evicted_from_hbm_comes_back_from_the_tier(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path_factory.getbasetemp() / "ds-cache"))
    rng = random.Random(5)
    first = [rng.randrange(1, 500) for _ in range(150)]
    others = [[rng.randrange(1, 500) for _ in range(150)] for _ in range(6)]
    reference = LLM(model="random:tiny", dtype="float32", device="cpu", cache_memory="64MiB", max_model_len=1024,
                    enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    disk = tmp_path_factory.mktemp("tier")
    with RemoteServer(*TIER_FLAGS, "--kv-offloading-disk-path", str(disk), "--kv-offloading-disk-size",
                      "64MiB") as server, server.client(timeout=120) as client:

        def complete(prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        answer = complete(first)
        for prompt in others:  # their checkpoints push the first conversation's out of HBM
            complete(prompt)
        follow_up = first + answer + [7, 8, 9]
        got = complete(follow_up)
        metrics = scrape(client)
    want = reference.generate({"prompt_token_ids": follow_up}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got == list(want)
    assert metrics["deltaserve:offload_loads_total"] >= 1 and metrics["deltaserve:offload_hit_tokens_total"] >= 64
    assert metrics["deltaserve:offload_tier_hits_total{tier=host}"] >= 1  # its state image (HBM kept its KV)
    assert metrics["deltaserve:offload_tier_stored_bytes_total{tier=disk}"] > 0
    assert sum(v for k, v in metrics.items() if k.startswith("deltaserve:state_checkpoints_evicted_total")) >= 1
