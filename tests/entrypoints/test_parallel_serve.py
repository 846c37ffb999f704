"""`deltaserve serve -tp 2 -pp 2` answers /v1/completions with the single-process engine's greedy tokens,
and /metrics carries each pipeline stage's busy time and the batches in flight.

The server's engine core runs the multi-process executor: four rank processes (gloo on the CPU) under
the core process, all in the server's process group, which the test stops.
"""

from __future__ import annotations

from deltaserve import LLM, SamplingParams
from entrypoints.server import RemoteServer, scrape

PROMPT = [5, 300, 17, 257, 42, 511, 9, 100, 77, 3, 64]


def test_tp2_pp2_server_answers_completions_like_one_process(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path_factory.getbasetemp() / "ds-cache"))
    options = dict(dtype="float32", device="cpu", cache_memory="64MiB", max_model_len=1024)
    want = LLM(model="random:tiny", **options).generate({"prompt_token_ids": PROMPT},
                                   SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].token_ids
    with RemoteServer("-tp", "2", "-pp", "2", "--dtype", "float32", "--device", "cpu",
                      startup_timeout_s=240.0) as server:
        with server.client(timeout=120) as client:
            body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            metrics = scrape(client)
        assert choice["token_ids"] == list(want)
        for stage in ("0", "1"):  # both stages ran the request's steps
            assert metrics[f"deltaserve:pipeline_stage_busy_seconds_total{{stage={stage}}}"] > 0
            assert metrics[f"deltaserve:pipeline_stage_steps_total{{stage={stage}}}"] > 0
        assert metrics["deltaserve:pipeline_batches_in_flight"] == 0
        assert metrics["deltaserve:pipeline_max_batches_in_flight"] >= 1
        assert "multi-process executor: tensor_parallel_size=2 x pipeline_parallel_size=2 over 1 node(s)" in server.log
        assert "node 0 (" in server.log and "rank 3 on cpu" in server.log
