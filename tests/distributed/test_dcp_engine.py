"""Decode context parallelism through `LLM` (gloo, float32, CPU): TP=2 x DCP=2 (interleave 1 and the
block size; and with MLA prefill attending to cached context in pieces) and TP=2 x DCP=2 x PP=2 give
TP alone's greedy tokens and logprobs within 1e-4, on the scenarios of test_multiproc_engine (chunked
prefill, prefix caching and KDA checkpoints, a multi-turn follow-up, preemption, an abort); the capacity
grows with the group; the refusals name their cause.

Each world is one module-scoped engine whose rank processes start once and are stopped by the
fixture. The DCP worlds get half the KV blocks of TP alone: a block covers twice the tokens there,
so both hold the same context and the scenarios preempt alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.config.engine_config import EngineConfig
from distributed.test_multiproc_engine import _assert_same, run_scenarios

COMMON = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, block_size=16, max_num_seqs=4)
TP_ALONE = dict(tensor_parallel_size=2, num_kv_blocks=18)
WORLDS = {
    "tp2_dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2, num_kv_blocks=9),
    "tp2_dcp2_interleave16": dict(tensor_parallel_size=2, decode_context_parallel_size=2,
                                  dcp_kv_cache_interleave_size=16, num_kv_blocks=9),
    "tp2_dcp2_pp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2, pipeline_parallel_size=2,
                         num_kv_blocks=9),
    "tp2_dcp2_context_pieces": dict(tensor_parallel_size=2, decode_context_parallel_size=2, num_kv_blocks=9),
}
# the rank processes' environment, by world: MLA prefill after more than 16 tokens of context gathers it
# from the group's stripes and attends to it in pieces of 16 (mla._attend_long_context)
WORLD_ENV = {"tp2_dcp2_context_pieces": {"DELTASERVE_MLA_EXPANSION_TOKENS": "16"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = checkpoint_dir(tmp_path_factory, "dcp", tiny_hub_config(), seed=31)
    return path


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    llm = LLM(model=model_dir, **COMMON, **TP_ALONE)
    try:
        return run_scenarios(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, model_dir) -> Iterator[dict]:
    with pytest.MonkeyPatch.context() as patch:  # the ranks are spawned with the environment of the moment
        for name, value in WORLD_ENV.get(request.param, {}).items():
            patch.setenv(name, value)
        llm = LLM(model=model_dir, **COMMON, **WORLDS[request.param])
    try:
        yield run_scenarios(llm)
    finally:
        llm.shutdown()


def test_dcp_equals_tp_alone(world, reference):
    for key in ("turn1", "turn2"):
        _assert_same(world[key], reference[key], key)
    assert world["turn2_cached"] > 0, "the second turn must start from the first turn's cache"
    for i, (got, want) in enumerate(zip(world["batch"], reference["batch"], strict=True)):
        _assert_same(got, want, f"batch request {i}")
    assert world["preemptions"] > 0
    assert world["abort"].keys() == reference["abort"].keys()
    for request_id, tokens in reference["abort"].items():
        if request_id != "abort1":
            assert world["abort"][request_id] == tokens, request_id


def test_capacity_grows_with_the_group(model_dir):
    """The same cache budget: TP alone cannot hold a 4096-token context, TP=2 x DCP=2 can, and serves a
    3000-token prompt with TP alone's tokens (computed there on a budget that fits it)."""
    budget = dict(cache_memory=420_000, max_num_seqs=1, enable_prefix_caching=False, dtype="float32", device="cpu",
                  max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="the largest max_model_len that fits is"):
        LLM(model=model_dir, tensor_parallel_size=2, max_model_len=4096, **budget)
    prompt = {"prompt_token_ids": random_prompts([3000], 320, seed=12)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=model_dir, tensor_parallel_size=2, decode_context_parallel_size=2, max_model_len=4096, **budget)
    try:
        assert llm.llm_engine.cache_plan.num_blocks * 32 >= 4096
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    roomy = LLM(model=model_dir, tensor_parallel_size=2, max_model_len=4096, **{**budget, "cache_memory": 2_000_000})
    try:
        want = roomy.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        roomy.shutdown()
    assert got == want


@pytest.mark.parametrize(("options", "message"), [
    (dict(tensor_parallel_size=2, decode_context_parallel_size=4),
     "decode_context_parallel_size=4 must divide tensor_parallel_size=2"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_kv_cache_interleave_size=3),
     "dcp_kv_cache_interleave_size=3 must divide block_size=16"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, state_checkpoint_interval=16),
     r"checkpoint grid, 64 tokens \(block_size=16 x decode_context_parallel_size=2"),
])
def test_unservable_settings_are_refused_naming_both(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(block_size=16, **options)
