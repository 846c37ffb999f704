"""P/D across parallel layouts: a pipeline-parallel producer feeding a tensor (and decode context)
parallel consumer, each engine's ranks as processes over gloo, over NIXL and Mooncake.

P PP2 -> D TP2 and P PP2 -> D TP2 x DCP2: every consumer rank reads its KDA heads from the producer
stage holding each layer and its latent tokens by range; greedy tokens equal a colocated single-process
engine's, logprobs within 1e-4, with prefix caching and a second turn; after many requests nothing is
held on any producer stage or on the consumer. Engines start once per module (rank processes are
expensive on two cores) and are shut down, with their ranks, at the module's end.
"""

from __future__ import annotations

import pytest

from deltaserve import LLM
from deltaserve.kv_transfer import available_backends

from .test_pd_engine import COMMON, _assert_same, _core, _decode, _greedy, _prefill, _settle

SETTLE_S = 20.0  # rank processes on two cores are slower to release

LAYOUTS = {
    "pp2_to_tp2": ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}),
    "pp2_to_tp2_dcp2": ({"pipeline_parallel_size": 2},
                        {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
}
# (connector, backend, layout, staging_chunk_pages): staging at 1 and 4 pages per chunk on a DCP consumer
CASES = [(connector, backend, layout, 0) for connector, backend in (("NixlConnector", "nixl"),
                                                                     ("MooncakeConnector", "mooncake"))
         for layout in LAYOUTS]
CASES += [("MooncakeConnector", "mooncake", "pp2_to_tp2_dcp2", 1), ("NixlConnector", "nixl", "pp2_to_tp2_dcp2", 4)]
PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n" * 4,  # several prefill chunks
]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**COMMON)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module", params=CASES,
                ids=[f"{c[0]}-{c[2]}" + (f"-staged{c[3]}" if c[3] else "") for c in CASES])
def pair(request):
    connector, backend, layout, staging_chunk_pages = request.param
    if backend not in available_backends():
        pytest.skip(f"{connector}'s library is not installed; install it as the README says")
    producer_sizes, consumer_sizes = LAYOUTS[layout]
    producer = LLM(**COMMON, **producer_sizes, distributed_executor_backend="mp",
                   kv_transfer_config={"kv_connector": connector, "kv_role": "kv_producer",
                                       "staging_chunk_pages": staging_chunk_pages, "staging_slots": 2})
    try:
        consumer = LLM(**COMMON, **consumer_sizes, distributed_executor_backend="mp",
                       kv_transfer_config={"kv_connector": connector, "kv_role": "kv_consumer"})
    except BaseException:
        producer.llm_engine.shutdown()
        raise
    yield producer, consumer
    for llm in (producer, consumer):
        llm.llm_engine.shutdown()


def test_parallel_pairing_equals_colocated(pair, reference):
    producer, consumer = pair
    ids = [reference.generate([p], _greedy(1), use_tqdm=False)[0].prompt_token_ids for p in PROMPTS]
    want = reference.generate([{"prompt_token_ids": i} for i in ids], _greedy(10), use_tqdm=False)
    prefilled = _prefill(producer, ids)
    _assert_same(_decode(consumer, ids, prefilled, 10), want)
    _settle(producer, consumer, SETTLE_S)

    turn2 = [list(i) + list(w.outputs[0].token_ids) + ids[0][:5] for i, w in zip(ids, want, strict=True)]
    want2 = reference.generate([{"prompt_token_ids": i} for i in turn2], _greedy(6), use_tqdm=False)
    prefilled2 = _prefill(producer, turn2)
    assert any(p.num_cached_tokens > 0 for p in prefilled2)
    _assert_same(_decode(consumer, turn2, prefilled2, 6), want2)
    _settle(producer, consumer, SETTLE_S)
    staged = _core(consumer).kv_transfer.metrics()["staged_chunks"]
    dcp = _core(consumer).config.decode_context_parallel_size
    staging = _core(producer).config.kv_transfer_config.staging_chunk_pages
    assert (staged > 0) == bool(staging and dcp > 1), (staged, staging, dcp)


def test_many_requests_leave_nothing_held_on_any_stage(pair):
    producer, consumer = pair
    ids = [[(7 * n + k) % 200 + 3 for k in range(9 + n % 5)] for n in range(16)]
    prefilled = _prefill(producer, ids)
    assert len(_core(producer).scheduler.held_for_transfer) == len(ids)
    _decode(consumer, ids, prefilled, 2)
    _settle(producer, consumer, SETTLE_S)
    # one scheduler frees every stage's blocks; no consumer rank's release is left waiting for the others
    assert _core(producer).kv_transfer.metrics()["partially_released"] == 0


@pytest.mark.skipif("mooncake" not in available_backends(), reason="needs Mooncake")
def test_a_decode_tp_not_a_multiple_of_the_prefill_tp_is_refused_naming_both():
    """P TP2 -> D TP1: the consumer's handshake refuses the pairing; the request fails with both
    sides' sizes even under the "recompute" policy (a configuration error, not a lost transfer)."""
    config = {"kv_connector": "MooncakeConnector"}
    producer = LLM(**COMMON, tensor_parallel_size=2, distributed_executor_backend="mp",
                   kv_transfer_config={**config, "kv_role": "kv_producer"})
    consumer = LLM(**COMMON, kv_transfer_config={**config, "kv_role": "kv_consumer",
                                                 "kv_load_failure_policy": "recompute"})
    try:
        ids = [[5, 6, 7, 8, 9, 10, 11]]
        prefilled = _prefill(producer, ids)
        engine = consumer.llm_engine
        engine.add_request("refused", {"prompt_token_ids": ids[0]},
                           _greedy(4, kv_transfer_params=prefilled[0].kv_transfer_params))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        (out,) = [o for o in outputs if o.finished]
        assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
        why = str(out.outputs[0].stop_reason)
        assert "decode tensor_parallel_size=1 is not a multiple of prefill tensor_parallel_size=2" in why
        _settle(producer, consumer, SETTLE_S)
    finally:
        for llm in (producer, consumer):
            llm.llm_engine.shutdown()
