"""The draft-model drafter through the engine: with the target's own checkpoint as its draft, greedy
acceptance is 1.0 and the tokens are plain decoding's, for k = 1, 3, 5; a different (random) draft is
lossless too, with prefix caching, chunked prefill, preemption and a second turn that hits the cache;
and under PP=2 and TP=2 the drafter runs on the output rank only."""

from __future__ import annotations

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams

from .test_spec_engine import assert_nothing_held

COMMON = {"dtype": "float32", "device": "cpu", "block_size": 16, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, _ = checkpoint_dir(tmp_path_factory, "target", tiny_hub_config(), seed=51)
    draft, _ = checkpoint_dir(tmp_path_factory, "draft", tiny_hub_config(num_hidden_layers=2, linear_attn_config=dict(
        head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1], full_attn_layers=[2])), seed=52)
    return target, draft


def prompts():
    return random_prompts([23, 40, 9, 70], 320, seed=13)


def greedy(n=20):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm, batch, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(dirs):
    return run(LLM(model=dirs[0], **COMMON, enable_prefix_caching=False), prompts(), greedy())


def spec(model, k):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_target_as_its_own_draft_accepts_everything(dirs, reference, k):
    llm = LLM(model=dirs[0], **COMMON, speculative_config=spec(dirs[0], k))
    assert run(llm, prompts(), greedy()) == reference
    metrics = llm.get_metrics()["spec_decode"]
    assert metrics["num_drafts"] > 0 and metrics["acceptance_rate"] == 1.0, metrics
    assert_nothing_held(llm)


def test_a_smaller_draft_is_lossless_with_caching_chunks_and_preemption(dirs, reference):
    llm = LLM(model=dirs[0], **{**COMMON, "max_num_batched_tokens": 24}, num_kv_blocks=14,
              speculative_config=spec(dirs[1], 3))
    assert run(llm, prompts(), greedy()) == reference
    assert llm.get_metrics()["scheduler"]["num_preemptions"] > 0
    assert_nothing_held(llm)
    llm = LLM(model=dirs[0], **COMMON, speculative_config=spec(dirs[1], 3))
    assert run(llm, prompts(), greedy()) == reference
    second = [p + a + p[:3] for p, a in zip(prompts(), reference, strict=True)]
    want = run(LLM(model=dirs[0], **COMMON, enable_prefix_caching=False), second, greedy(12))
    assert run(llm, second, greedy(12)) == want
    assert llm.get_metrics()["prefix_cache"]["hit_tokens"] > 0
    assert_nothing_held(llm)


def test_refusals(dirs):
    with pytest.raises(ValueError, match="vocab"):
        LLM(model=dirs[0], **COMMON, speculative_config=spec("random:small", 2))
    with pytest.raises(ValueError, match="needs \"model\""):
        LLM(model=dirs[0], **COMMON, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_an_abort_mid_run_frees_everything(dirs):
    llm = LLM(model=dirs[0], **COMMON, speculative_config=spec(dirs[1], 3))
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy())
    for _ in range(6):
        engine.step()
    engine.abort_request(["r1", "r3"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)
    drafter = engine.core.executor.worker.runner.drafter if hasattr(engine.core.executor, "worker") else None
    if drafter is not None:  # the drafter forgets the aborted requests when the next step names them
        llm.generate([{"prompt_token_ids": prompts()[0]}], greedy(2), use_tqdm=False)
        assert not {"r1", "r3"} & set(drafter.known.tokens)


def test_the_draft_models_caches_come_out_of_the_cache_budget(dirs):
    """The same cache_memory: the target's caches shrink by the draft model's share (its latents per token,
    twice its state image per slot), so both fit the budget."""
    plain = LLM(model=dirs[0], **COMMON, cache_memory="32MiB")
    drafted = LLM(model=dirs[0], **COMMON, cache_memory="32MiB", speculative_config=spec(dirs[1], 3))
    plain_plan, drafted_plan = plain.llm_engine.core.cache_plan, drafted.llm_engine.core.cache_plan
    assert drafted_plan.num_blocks < plain_plan.num_blocks
    worker = drafted.llm_engine.core.executor.worker
    share = worker._draft_cache_share()
    assert share == 1.0  # one MLA layer each: the same latents per token (and 2 x 1 KDA layer of 3 for the state)
    drafter = worker.runner.drafter
    draft_bytes = sum(t.numel() * t.element_size() for layer in drafter.model.mla_layers() for t in [layer.kv_cache])
    draft_bytes += sum(t.numel() * t.element_size() for layer in drafter.model.kda_layers()
                       for t in (layer.conv_state, layer.recurrent_state))
    assert draft_bytes <= 32 * 2**20 - worker.available_cache_bytes() + 2**20


def test_the_drafters_decode_steps_through_the_graph_layout(dirs, reference):
    """The draft model's decode steps (catching up and drafting) laid out as its CUDA graphs run them
    (padded to a captured size, padding in the block and state row past the shared ids; eagerly here):
    the target as its own draft still accepts everything."""
    from deltaserve.worker.cuda_graph import DecodeGraphs

    llm = LLM(model=dirs[0], **COMMON, max_num_seqs=4, speculative_config=spec(dirs[0], 3))
    drafter = llm.llm_engine.executor.worker.runner.drafter
    layout = DecodeGraphs(drafter.model, drafter.device, drafter.block_size, drafter.max_model_len,
                          drafter.pad_block, drafter.pad_state_slot)
    layout.lay_out_without_capture([2, 4])
    drafter.graphs = layout
    served, replay = [], layout.run
    layout.run = lambda input_ids, ctx: served.append(ctx.num_decodes) or replay(input_ids, ctx)
    assert run(llm, prompts(), greedy()) == reference
    assert served and any(n not in (2, 4) for n in served), served  # padded batches
    assert llm.get_metrics()["spec_decode"]["acceptance_rate"] == 1.0
    assert_nothing_held(llm)
