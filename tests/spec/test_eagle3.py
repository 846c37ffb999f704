"""The Eagle3 drafter through the engine: a random head over the tiny target is lossless (greedy tokens of
plain decoding) with prefix caching and chunked prefill; under PP=2 and PP=4 the tap states of earlier
stages are relayed with the stream, stages that own no tap included; a relay of the wrong width is refused;
the head's vocabulary, width and taps are checked against the target at startup."""

from __future__ import annotations

import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.eagle3 import random_eagle3_head, save_eagle3
from deltaserve.model.kimi_linear import IntermediateTensors, KimiLinearForCausalLM

from .test_spec_engine import assert_nothing_held

COMMON = {"dtype": "float32", "device": "cpu", "block_size": 16, "max_num_batched_tokens": 48, "num_kv_blocks": 32}
# KDA, KDA, MLA, KDA, KDA, MLA, KDA, KDA: PP=4 gives every stage a KDA layer; the default taps (2, 4, 5)
# sit on stages 1 and 2, none on stages 0 and 3
EIGHT_LAYERS = tiny_hub_config(num_hidden_layers=8, linear_attn_config=dict(
    head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 4, 5, 7, 8], full_attn_layers=[3, 6]))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, _ = checkpoint_dir(tmp_path_factory, "e3target", EIGHT_LAYERS, seed=61)
    head_dir = str(tmp_path_factory.mktemp("e3head"))
    config = KimiLinearConfig.from_dict(EIGHT_LAYERS)
    head = random_eagle3_head(config.vocab_size, config.hidden_size, config.num_hidden_layers, seed=3)
    assert head.config.tap_layer_ids == (2, 4, 5)
    save_eagle3(head, head_dir, torch.float32)
    return target, head_dir


def prompts():
    return random_prompts([25, 50, 11], 320, seed=17)


def greedy(n=16):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm, batch):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(dirs):
    return run(LLM(model=dirs[0], **COMMON, enable_prefix_caching=False), prompts())


def spec(head_dir, k=3):
    return {"method": "eagle3", "model": head_dir, "num_speculative_tokens": k}


@pytest.mark.parametrize("world", [{}, {"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 4}],
                         ids=["pp1", "pp2", "pp4"])
def test_eagle3_is_lossless_and_taps_cross_the_stages(dirs, reference, world):
    llm = LLM(model=dirs[0], **COMMON, **world, speculative_config=spec(dirs[1]))
    try:
        assert run(llm, prompts()) == reference
        assert run(llm, prompts()) == reference  # prefix hits: the head starts from its first tapped position
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
        assert_nothing_held(llm)
    finally:
        llm.llm_engine.shutdown()


def test_a_relay_of_the_wrong_width_is_refused():
    config = KimiLinearConfig.from_dict(EIGHT_LAYERS)
    stage = KimiLinearForCausalLM(config, ParallelConfig(pipeline_parallel_size=2, pipeline_parallel_rank=1),
                                  torch.float32)
    stage.tap_layer_ids = (2, 4, 5)  # tap 2 lives on stage 0: one hidden-size column block is expected
    hidden = torch.zeros(3, config.hidden_size)
    assert stage._relayed_taps(IntermediateTensors(hidden, hidden, torch.zeros(3, config.hidden_size)))
    for wrong in (None, torch.zeros(3, 2 * config.hidden_size)):
        with pytest.raises(RuntimeError, match="relayed"):
            stage._relayed_taps(IntermediateTensors(hidden, hidden, wrong))


def test_a_head_that_does_not_fit_the_target_is_refused(dirs, tmp_path):
    head = random_eagle3_head(320, 32, 8, seed=1)  # half the target's width
    save_eagle3(head, str(tmp_path), torch.float32)
    with pytest.raises(ValueError, match="target_hidden_size"):
        LLM(model=dirs[0], **COMMON, speculative_config=spec(str(tmp_path)))


@pytest.mark.parametrize("k", [1, 5])
def test_eagle3_k_with_chunked_prefill_preemption_and_an_abort(dirs, reference, k):
    llm = LLM(model=dirs[0], **{**COMMON, "max_num_batched_tokens": 20, "num_kv_blocks": 9},
              speculative_config=spec(dirs[1], k))
    assert run(llm, prompts()) == reference
    assert llm.get_metrics()["scheduler"]["num_preemptions"] > 0
    engine = llm.llm_engine
    engine.add_request("gone", {"prompt_token_ids": prompts()[1]}, greedy())
    for _ in range(5):
        engine.step()
    engine.abort_request(["gone"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def test_eagle3_taps_come_through_the_graph_layouts(dirs, reference):
    """Decode and verify steps laid out as their CUDA graphs would run them (padded, decode rows as
    one-token windows, run eagerly here) hand the drafter the tap rows of the step's own rows: every
    draft is the one the unpadded steps give."""
    from deltaserve.worker.cuda_graph import DecodeGraphs

    from .test_spec_engine import lay_out_verify_graphs

    options = {**COMMON, "max_num_batched_tokens": 10, "max_num_seqs": 4}  # a small budget cuts windows short

    def drafting(layouts):
        llm = LLM(model=dirs[0], **options, speculative_config=spec(dirs[1]))
        runner = llm.llm_engine.executor.worker.runner
        drafts, propose = [], runner.drafter.propose

        def recording(*args):
            proposed = propose(*args)
            drafts.append(sorted(proposed.items()))
            return proposed

        runner.drafter.propose = recording
        served = None
        if layouts:
            served = lay_out_verify_graphs(llm, 3, sizes=(1, 2, 4))
            engine = llm.llm_engine
            decode = DecodeGraphs(runner.model, runner.device, 16, engine.config.max_model_len or 2048,
                                  engine.cache_plan.num_blocks, engine.cache_plan.num_state_slots)
            decode.lay_out_without_capture([1, 2, 4])
            runner.decode_graphs = decode
        assert run(llm, prompts()) == reference
        return drafts, served

    plain, _ = drafting(False)
    laid_out, served = drafting(True)
    assert any(decodes or len(set(lengths)) > 1 for decodes, lengths in served), served  # rows reordered
    assert laid_out == plain
