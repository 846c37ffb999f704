"""Speculative decoding under pipeline, tensor and decode context parallelism (the multi-process executor, gloo on the
CPU): every stage runs the verify windows for its own KDA layers and rolls its own spare slots back when
the next step brings the accept counts; greedy tokens equal the single-process engine without speculation.
One engine per world, module-scoped: its rank processes start once and the fixture stops them."""

from __future__ import annotations

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams

from .test_spec_engine import OracleDrafts, assert_counters_add_up, assert_nothing_held

COMMON = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 32, "num_kv_blocks": 24, "block_size": 16,
          "max_num_seqs": 4}
WORLDS = {
    "pp2": {"pipeline_parallel_size": 2, "pp_max_inflight": 2},
    "tp2": {"tensor_parallel_size": 2},
}
# decode context parallelism: a verify window's MLA runs as a prefill chunk over the striped latents
NGRAM_ONLY = {"tp2_dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    out, _ = checkpoint_dir(tmp_path_factory, "spec_mp", tiny_hub_config(), seed=43)
    return out


def prompts_and_params():
    prompts = [p * 2 for p in random_prompts([21, 30, 12, 40], 320, seed=11)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(model_dir):
    prompts, params = prompts_and_params()
    llm = LLM(model=model_dir, **COMMON)
    return run(llm, prompts, params)


@pytest.fixture(scope="module", params=sorted(WORLDS) + sorted(NGRAM_ONLY))
def world(request, model_dir):
    llm = LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **COMMON, **{**WORLDS, **NGRAM_ONLY}[request.param])
    yield request.param, llm
    llm.llm_engine.shutdown()


def test_greedy_identical_under_parallelism(world, reference):
    name, llm = world
    prompts, params = prompts_and_params()
    llm.llm_engine.scheduler.spec.proposer = OracleDrafts(prompts, reference, seed=3)
    assert run(llm, prompts, params) == reference, name
    assert_counters_add_up(llm)
    # a second round: prompts that hit the prefix cache, then verify from the loaded state
    assert run(llm, prompts, params) == reference, name
    assert_nothing_held(llm)


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_draft_model_on_the_output_rank(model_dir, reference, name):
    """The target's own checkpoint as the draft, loaded by the output rank only: every draft accepted."""
    prompts, params = prompts_and_params()
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
    llm = LLM(model=model_dir, speculative_config=spec, **COMMON, **WORLDS[name])
    try:
        assert run(llm, prompts, params) == reference, name
        metrics = llm.get_metrics()["spec_decode"]
        assert metrics["num_drafts"] > 0 and metrics["acceptance_rate"] == 1.0, metrics
        assert_nothing_held(llm)
    finally:
        llm.llm_engine.shutdown()
