"""Chunked transfer between two engines in this process, over NIXL and Mooncake: the producer gives a
request's kv_transfer_params when it is added, and the consumer reads each prefill chunk's latents
while the producer's prefill goes on, then the KDA state and the first token once it finished.

The two engine cores are stepped in turn by hand, so the consumer's reads provably start before the
producer's prefill ends. Greedy tokens equal a colocated engine's (logprobs within 1e-4); nothing is
left held or streamed on either side afterwards; a producer request aborted mid-prefill fails or
recomputes its consumer's load, by policy; a DCP decode refuses chunked params at admission.
"""

from __future__ import annotations

import time

import pytest

from deltaserve import LLM
from deltaserve.engine.core import EngineCore, EngineCoreRequest
from deltaserve.kv_transfer import available_backends
from deltaserve.kv_transfer.config import KVTransferConfig
from deltaserve.kv_transfer.metadata import RemoteSource
from deltaserve.kv_transfer.scheduler_side import KVConnectorScheduler
from deltaserve.sampling_params import SamplingParams
from kv_transfer.test_pd_engine import COMMON, CONNECTORS, LOGPROB_TOL, PROMPTS, _greedy

LONG = PROMPTS[1] * 4  # about 290 tokens: six prefill chunks of 48


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**COMMON)
    yield llm
    llm.llm_engine.shutdown()


def _pair(connector: str, policy: str = "recompute") -> tuple[LLM, LLM]:
    if CONNECTORS[connector] not in available_backends():
        pytest.skip(f"{connector}'s library is not installed; install it as the README says")
    producer = LLM(**COMMON, kv_transfer_config={"kv_connector": connector, "kv_role": "kv_producer",
                                                 "chunked_transfer": True})
    consumer = LLM(**COMMON, kv_transfer_config={"kv_connector": connector, "kv_role": "kv_consumer",
                                                 "kv_load_failure_policy": policy})
    return producer, consumer


@pytest.fixture(scope="module", params=list(CONNECTORS))
def pair(request):
    producer, consumer = _pair(request.param)
    yield producer, consumer
    for llm in (producer, consumer):
        llm.llm_engine.shutdown()


def _core(llm: LLM) -> EngineCore:
    return llm.llm_engine.core


def _request(request_id: str, ids: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(ids), params, params.max_tokens)


def _start(producer: EngineCore, request_id: str, ids: list[int]) -> dict:
    """Adds the prefill leg; its params come out of the next step, before any token."""
    producer.add_request(_request(request_id, ids, _greedy(1, kv_transfer_params={"do_remote_decode": True})))
    outputs, _ = producer.step()
    (early,) = [o for o in outputs if o.request_id == request_id]
    assert early.new_token_ids == [] and early.finish_reason is None
    return early.kv_transfer_params


def _run_both(producer: EngineCore, consumer: EngineCore) -> tuple[dict[str, list], int]:
    """Steps both cores in turn until neither has work; returns the consumer's outputs per request
    and how many transfer descriptors the consumer posted while a producer stream still ran."""
    outputs: dict[str, list] = {}
    overlapped_ops = 0
    while producer.has_unfinished_requests() or consumer.has_unfinished_requests():
        if producer.has_unfinished_requests():
            producer.step()
        before = consumer.kv_transfer.num_ops
        for out in consumer.step()[0]:
            outputs.setdefault(out.request_id, []).append(out)
        streams = producer.kv_transfer.scheduler.streams
        if any(s["state"] == "running" for s in streams.values()):
            overlapped_ops += consumer.kv_transfer.num_ops - before
    return outputs, overlapped_ops


def _settle(producer: EngineCore, consumer: EngineCore) -> None:
    deadline = time.monotonic() + 10
    while (producer.scheduler.held_for_transfer or producer.kv_transfer.scheduler.streams) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
        producer.poll_transfers()
    assert not producer.kv_transfer.scheduler.streams, "a stream entry outlived its request"
    for core in (producer, consumer):
        scheduler = core.scheduler
        assert not scheduler.held_for_transfer and not scheduler.remote_waiting and not scheduler.has_pending_transfers
        assert scheduler.state_pool.num_free == scheduler.state_pool.num_slots
        scheduler.check_invariants()


def test_the_consumer_reads_while_the_prefill_runs_and_decodes_as_colocated(pair, reference):
    producer, consumer = (_core(llm) for llm in pair)
    prompts = [LONG, PROMPTS[0], PROMPTS[2]]
    ids = [reference.generate([p], _greedy(1), use_tqdm=False)[0].prompt_token_ids for p in prompts]
    want = reference.generate([{"prompt_token_ids": i} for i in ids], _greedy(10), use_tqdm=False)
    for n, prompt_ids in enumerate(ids):
        early = _start(producer, f"p{n}", prompt_ids)
        assert early["chunked"] and early["remote_block_ids"] == [] and early["remote_num_tokens"] == len(prompt_ids)
        consumer.add_request(_request(f"d{n}", prompt_ids, _greedy(10, kv_transfer_params=early)))
    outputs, overlapped_ops = _run_both(producer, consumer)
    assert overlapped_ops > 0, "no read was posted while a prefill still ran"
    assert consumer._num_computed_tokens == 3 * 9  # no prompt token computed here; 9 decoded each
    for n, w in enumerate(want):
        got = outputs[f"d{n}"]
        assert [t for o in got for t in o.new_token_ids] == list(w.outputs[0].token_ids)
        logprobs = [lp for o in got for lp in (o.new_logprobs or [])]
        for lp, expected in zip(logprobs, w.outputs[0].logprobs, strict=True):
            assert abs(lp.logprobs[0] - expected[lp.token_ids[0]].logprob) <= LOGPROB_TOL
    _settle(producer, consumer)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_producer_request_aborted_mid_prefill(reference, policy):
    connector = next((c for c in CONNECTORS if CONNECTORS[c] in available_backends()), "MooncakeConnector")
    producer_llm, consumer_llm = _pair(connector, policy)
    producer, consumer = _core(producer_llm), _core(consumer_llm)
    try:
        ids = reference.generate([LONG], _greedy(1), use_tqdm=False)[0].prompt_token_ids
        early = _start(producer, "p", ids)
        consumer.add_request(_request("d", ids, _greedy(6, kv_transfer_params=early)))
        consumer.step()
        producer.step()
        producer.finish_requests(["p"])  # the prefill leg's client left
        assert producer.kv_transfer.scheduler.streams["p"]["state"] == "gone"
        outputs, _ = _run_both(producer, consumer)
        failures = dict(consumer.kv_transfer.take_failures())
        if policy == "recompute":
            want = reference.generate([{"prompt_token_ids": ids}], _greedy(6), use_tqdm=False)[0]
            assert [t for o in outputs["d"] for t in o.new_token_ids] == list(want.outputs[0].token_ids)
            assert not failures
        else:  # the request ends with an error naming why (the server answers it as such)
            assert "d" not in outputs and "aborted on the producer" in failures["d"]
        _settle(producer, consumer)  # the consumer's release took the ended stream's entry
    finally:
        producer_llm.llm_engine.shutdown()
        consumer_llm.llm_engine.shutdown()


def test_a_dcp_decode_refuses_chunked_params_at_admission():
    config = KVTransferConfig.parse({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    params = RemoteSource("prefill-0", "127.0.0.1", 5555, "r", [], 16, -1, 40, -1, chunked=True).to_params()
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    with pytest.raises(ValueError, match="chunked transfer.*decode_context_parallel_size=2"):
        KVConnectorScheduler(config, 16, decode_context_parallel_size=2).remote_source(sampling, 40)
    source = KVConnectorScheduler(config, 16).remote_source(sampling, 40)
    assert source.chunked and source.block_ids == [] and source.num_tokens == 40
