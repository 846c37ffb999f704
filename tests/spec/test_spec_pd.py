"""Speculative decoding on a P/D consumer: the producer never speculates; the consumer's first step after
the load is a verify window with no local prefill, and its greedy tokens equal a colocated engine's.
Mooncake's TCP transport on the CPU (skipped where it is not installed)."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.kv_transfer import available_backends

from .test_spec_engine import OracleDrafts, assert_counters_add_up

COMMON = {"dtype": "float32", "enable_prefix_caching": True, "max_num_batched_tokens": 48}
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n" * 3]

pytestmark = pytest.mark.skipif("mooncake" not in available_backends(), reason="needs Mooncake")


def greedy(max_tokens, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra or None)


def test_consumer_verifies_from_its_first_decode():
    reference = LLM(**COMMON)
    producer = LLM(**COMMON, speculative_config=SPEC,
                   kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})
    consumer = LLM(**COMMON, speculative_config=SPEC,
                   kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})
    try:
        assert producer.llm_engine.scheduler.spec is None  # a producer never speculates
        ids = [reference.generate([p], greedy(1), use_tqdm=False)[0].prompt_token_ids for p in PROMPTS]
        want = [list(o.outputs[0].token_ids)
                for o in reference.generate([{"prompt_token_ids": i} for i in ids], greedy(16), use_tqdm=False)]
        consumer.llm_engine.scheduler.spec.proposer = OracleDrafts(ids, want, vocab_size=1 << 16, seed=5)
        prefilled = producer.generate([{"prompt_token_ids": i} for i in ids],
                                      greedy(1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
        got = [list(consumer.generate([{"prompt_token_ids": i}], greedy(16, kv_transfer_params=p.kv_transfer_params),
                                      use_tqdm=False)[0].outputs[0].token_ids)
               for i, p in zip(ids, prefilled, strict=True)]
        assert got == want
        assert_counters_add_up(consumer)
        scheduler = consumer.llm_engine.scheduler
        assert scheduler.state_pool.num_free == scheduler.state_pool.num_slots
        scheduler.check_invariants()
    finally:
        for llm in (reference, producer, consumer):
            llm.llm_engine.shutdown()
