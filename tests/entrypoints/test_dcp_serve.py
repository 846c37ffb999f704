"""`deltaserve serve -tp 2 -dcp 2` answers /v1/completions with TP alone's greedy tokens and reports
the context capacity, twice TP alone's for the same cache budget, in /v1/models and its startup log.

The server's engine core runs two rank processes (gloo on the CPU) in the server's process group,
which the test stops.
"""

from __future__ import annotations

from deltaserve import LLM, SamplingParams
from entrypoints.server import RemoteServer

PROMPT = [5, 300, 17, 257, 42, 511, 9, 100, 77, 3, 64, 12, 8, 401, 33, 2, 90, 71, 18, 250]


def test_tp2_dcp2_server_answers_like_tp_alone_and_reports_its_capacity():
    options = dict(dtype="float32", device="cpu", cache_memory="64MiB", max_model_len=1024)
    alone = LLM(model="random:tiny", tensor_parallel_size=2, **options)
    try:
        want = alone.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=12,
                              ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        alone_capacity = alone.llm_engine.cache_plan.num_blocks * 16
    finally:
        alone.shutdown()
    with RemoteServer("-tp", "2", "-dcp", "2", "--dtype", "float32", "--device", "cpu",
                      startup_timeout_s=240.0) as server:
        with server.client(timeout=120) as client:
            body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            card = client.get("/v1/models").json()["data"][0]
        assert response.json()["choices"][0]["token_ids"] == list(want)
        assert card["kv_cache_capacity_tokens"] == 2 * alone_capacity
        assert f"({2 * alone_capacity} tokens of context)" in server.log
        assert "tp=2 pp=1 dcp=2" in server.log
