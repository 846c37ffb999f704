"""Prefill/decode disaggregation between two engines in this process, over NIXL and Mooncake.

A producer engine prefills each prompt (max_tokens=1, do_remote_decode) and holds its KV blocks and
KDA state slot; a consumer engine reads them over the transfer engine (host memory, loopback) and
decodes. Greedy tokens must equal a colocated engine's, logprobs within 1e-4, with prefix caching on
both sides, multi-chunk prompts and a second turn; afterwards nothing is held on either side. Also:
a consumer that never reads (the producer frees after its timeout), a producer gone before the read
("recompute" recomputes the prompt, "fail" ends the request), malformed kv_transfer_params and the
refusal of a PP consumer and a DCP producer. Multi-rank pairings: test_pd_parallel.py.
"""

from __future__ import annotations

import time

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.core import EngineCore
from deltaserve.kv_transfer import available_backends

CONNECTORS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}
COMMON = dict(dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=48)
LOGPROB_TOL = 1e-4
PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n" * 4,  # several prefill chunks
    "import os\nimport sys\n\n\ndef main(argv):\n",
]


def _core(llm: LLM) -> EngineCore:
    return llm.llm_engine.core


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, extra_args=extra or None)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**COMMON)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module", params=list(CONNECTORS))
def pair(request):
    if CONNECTORS[request.param] not in available_backends():
        pytest.skip(f"{request.param}'s library is not installed; install it as the README says")
    producer = LLM(**COMMON, kv_transfer_config={"kv_connector": request.param, "kv_role": "kv_producer"})
    consumer = LLM(**COMMON, kv_transfer_config={"kv_connector": request.param, "kv_role": "kv_consumer"})
    yield producer, consumer
    for llm in (producer, consumer):
        llm.llm_engine.shutdown()


def _prefill(producer: LLM, prompt_ids: list[list[int]]) -> list:
    params = _greedy(1, kv_transfer_params={"do_remote_decode": True})
    return producer.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)


def _decode(consumer: LLM, prompt_ids: list[list[int]], prefilled: list, max_tokens: int) -> list:
    return [consumer.generate([{"prompt_token_ids": ids}],
                              _greedy(max_tokens, kv_transfer_params=p.kv_transfer_params), use_tqdm=False)[0]
            for ids, p in zip(prompt_ids, prefilled, strict=True)]


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            (token, la), = ((t, lp.logprob) for t, lp in a.items() if t in b)
            assert abs(la - b[token].logprob) <= LOGPROB_TOL


def _settle(producer: LLM, consumer: LLM, within_s: float = 10.0) -> None:
    """Waits for every consumer rank's release to reach the producer, then checks nothing is held by
    either side's scheduler (which owns every stage's blocks and slots)."""
    core = _core(producer)
    deadline = time.monotonic() + within_s
    while core.scheduler.held_for_transfer and time.monotonic() < deadline:
        time.sleep(0.02)
        core.poll_transfers()
    for llm in (producer, consumer):
        scheduler = _core(llm).scheduler
        assert not scheduler.held_for_transfer and not scheduler.remote_waiting and not scheduler.has_pending_transfers
        assert scheduler.state_pool.num_free == scheduler.state_pool.num_slots
        scheduler.check_invariants()


def test_decode_after_remote_prefill_equals_colocated(pair, reference):
    producer, consumer = pair
    ids = [reference.generate([p], _greedy(1), use_tqdm=False)[0].prompt_token_ids for p in PROMPTS]
    want = reference.generate([{"prompt_token_ids": i} for i in ids], _greedy(12), use_tqdm=False)
    prefilled = _prefill(producer, ids)
    for p in prefilled:
        assert p.kv_transfer_params["do_remote_prefill"] and p.kv_transfer_params["remote_num_tokens"] > 0
    got = _decode(consumer, ids, prefilled, 12)
    _assert_same(got, want)
    _settle(producer, consumer)

    # a second turn: the answer and a follow-up appended (the producer hits its prefix cache)
    turn2 = [list(i) + list(w.outputs[0].token_ids) + ids[0][:5] for i, w in zip(ids, want, strict=True)]
    want2 = reference.generate([{"prompt_token_ids": i} for i in turn2], _greedy(8), use_tqdm=False)
    prefilled2 = _prefill(producer, turn2)
    assert any(p.num_cached_tokens > 0 for p in prefilled2)
    _assert_same(_decode(consumer, turn2, prefilled2, 8), want2)
    _settle(producer, consumer)


needs_mooncake = pytest.mark.skipif("mooncake" not in available_backends(), reason="needs Mooncake")


@needs_mooncake
def test_a_consumer_that_never_reads_is_freed_after_the_timeout():
    producer = LLM(**COMMON, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                                                 "transfer_timeout_s": 0.3})
    try:
        out = _prefill(producer, [[5, 6, 7, 8, 9] * 7])[0]
        core = _core(producer)
        assert out.kv_transfer_params is not None and len(core.scheduler.held_for_transfer) == 1
        time.sleep(0.4)
        core.poll_transfers()
        assert not core.scheduler.held_for_transfer and core.kv_transfer.scheduler.num_expired == 1
        core.scheduler.check_invariants()
    finally:
        producer.llm_engine.shutdown()


@needs_mooncake
def test_a_read_released_after_the_producers_timeout_is_not_trusted(reference, caplog):
    """The producer freed the request (its timeout passed) and reused the blocks before the consumer
    read them: the consumer's read completes, but the producer's answer to its release says the
    request was no longer held, so the load fails and the prompt is recomputed (the tokens stay right)."""
    producer = LLM(**COMMON, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                                                 "transfer_timeout_s": 0.3})
    consumer = LLM(**COMMON, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})
    try:
        ids = reference.generate([PROMPTS[1]], _greedy(1), use_tqdm=False)[0].prompt_token_ids
        prefilled = _prefill(producer, [ids])
        time.sleep(0.4)
        _core(producer).poll_transfers()  # expired: its blocks and slot are free
        assert _core(producer).kv_transfer.scheduler.num_expired == 1
        other = reference.generate([PROMPTS[0] * 6], _greedy(1), use_tqdm=False)[0].prompt_token_ids
        producer.generate([{"prompt_token_ids": other}], _greedy(1), use_tqdm=False)  # reuses the freed blocks
        got = _decode(consumer, [ids], prefilled, 6)
        _assert_same(got, reference.generate([{"prompt_token_ids": ids}], _greedy(6), use_tqdm=False))
        assert "freed the request (its transfer_timeout_s passed) before this read was released" in caplog.text
    finally:
        for llm in (producer, consumer):
            llm.llm_engine.shutdown()


@needs_mooncake
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_producer_gone_before_the_read(reference, policy):
    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy}
    consumer = LLM(**COMMON, kv_transfer_config=config)
    producer = LLM(**COMMON, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})
    try:
        ids = reference.generate([PROMPTS[2]], _greedy(1), use_tqdm=False)[0].prompt_token_ids
        prefilled = _prefill(producer, [ids])
        producer.llm_engine.shutdown()  # its side channel and memory are gone
        got = _decode(consumer, [ids], prefilled, 6)[0]
        if policy == "recompute":
            _assert_same([got], reference.generate([{"prompt_token_ids": ids}], _greedy(6), use_tqdm=False))
        else:
            assert got.finished and got.outputs[0].finish_reason == "abort" and not got.outputs[0].token_ids
        scheduler = _core(consumer).scheduler
        assert not scheduler.remote_waiting and not scheduler.has_pending_transfers
        assert scheduler.state_pool.num_free == scheduler.state_pool.num_slots
        scheduler.check_invariants()
    finally:
        consumer.llm_engine.shutdown()


def test_bad_transfer_params_are_refused_naming_the_field(pair):
    producer, consumer = pair
    with pytest.raises(ValueError, match="needs remote_engine_id"):
        consumer.generate(["hi"], _greedy(2, kv_transfer_params={"do_remote_prefill": True}), use_tqdm=False)
    prefilled = _prefill(producer, [[1, 2, 3, 4]])[0]
    with pytest.raises(ValueError, match="remote_num_tokens=4 but the prompt has 3 tokens"):
        consumer.generate([{"prompt_token_ids": [1, 2, 3]}],
                          _greedy(2, kv_transfer_params=prefilled.kv_transfer_params), use_tqdm=False)
    with pytest.raises(ValueError, match="do_remote_prefill needs a consumer engine"):
        producer.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                          _greedy(2, kv_transfer_params=prefilled.kv_transfer_params), use_tqdm=False)
    _decode(consumer, [[1, 2, 3, 4]], [prefilled], 2)  # read it, so nothing stays held
    _settle(producer, consumer)


def test_config_refusals():
    with pytest.raises(ValueError, match="kv_consumer \\(decode\\) engine cannot run pipeline parallel"):
        LLM(**COMMON, pipeline_parallel_size=2, kv_transfer_config={"kv_connector": "NixlConnector",
                                                                     "kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="kv_producer \\(prefill\\) engine cannot run decode context"):
        LLM(**COMMON, tensor_parallel_size=2, decode_context_parallel_size=2,
            kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    with pytest.raises(ValueError, match="kv_connector='Lmcache' is unknown"):
        LLM(**COMMON, kv_transfer_config='{"kv_connector": "Lmcache", "kv_role": "kv_producer"}')
    with pytest.raises(ValueError, match="unknown field"):
        LLM(**COMMON, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both", "x": 1})
