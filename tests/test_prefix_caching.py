"""Prefix caching through the whole engine on the tiny random model: outputs identical with caching on
and off over an interleaved multi-turn workload, each kind of checkpoint giving its hit, eviction
under a small cache, nothing leaked."""

from __future__ import annotations

import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out, _ = checkpoint_dir(tmp_path_factory, "prefix", tiny_hub_config(), seed=33)
    return out


def make_llm(model_dir, **options):
    options = {"dtype": "float32", "device": "cpu", "block_size": BS, "max_num_batched_tokens": 96, **options}
    return LLM(model=model_dir, **options)


def greedy(n=8):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def assert_nothing_held(llm):
    engine = llm.llm_engine
    s = engine.scheduler
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == engine.cache_plan.num_blocks
    assert s.state_pool.num_free == engine.cache_plan.num_state_slots
    if engine.prefix_cache is not None:
        assert all(cp.pins == 0 for cp in engine.prefix_cache.checkpoints._lru.values())
    s.check_invariants()
    assert not s.in_flight


def run_sessions(llm, num_sessions=3, num_turns=3):
    """Sessions sharing a system prompt; each turn = previous prompt + previous answer + a new message.
    The turns of all sessions are interleaved in one engine (one generate call per turn round)."""
    system = random_prompts([70], 320, seed=1)[0]
    messages = random_prompts([5 + 7 * i for i in range(num_sessions * (num_turns + 1))], 320, seed=2)
    prompts = [system + messages[s] for s in range(num_sessions)]
    results = []
    for turn in range(num_turns):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        results.append(outs)
        prompts = [
            p + o.outputs[0].token_ids + messages[(turn + 1) * num_sessions + s]
            for s, (p, o) in enumerate(zip(prompts, outs, strict=True))
        ]
    return results


def test_multi_turn_outputs_identical_with_caching_on_and_off(model_dir):
    on = make_llm(model_dir, state_checkpoint_interval=64)
    off = make_llm(model_dir, enable_prefix_caching=False)
    got, ref = run_sessions(on), run_sessions(off)
    for turn_got, turn_ref in zip(got, ref, strict=True):
        for a, b in zip(turn_got, turn_ref, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
                assert abs(la[t].logprob - lb[t].logprob) < 1e-5
    # later turns resume at the end of the previous answer
    assert all(o.num_cached_tokens > 0 for turn in got[1:] for o in turn)
    assert all(o.num_cached_tokens == 0 for turn in ref for o in turn)
    metrics = on.get_metrics()
    assert metrics["checkpoints"]["filed"]["end_of_sequence"] > 0
    assert metrics["prefix_cache"]["hit_tokens"] > 0
    assert_nothing_held(on)
    assert_nothing_held(off)


def test_end_of_sequence_anchor_hit(model_dir):
    llm = make_llm(model_dir)
    prompt = random_prompts([40], 320, seed=3)[0]
    (first,) = llm.generate([{"prompt_token_ids": prompt}], greedy(30), use_tqdm=False)
    answer = first.outputs[0].token_ids
    # generate() returns once the end-of-sequence save has run: the checkpoint is written, not just findable
    cps = llm.llm_engine.prefix_cache.checkpoints._lru.values()
    assert any(cp.kind.value == "end_of_sequence" for cp in cps)
    assert all(cp.visible and cp.written for cp in cps)
    assert not llm.llm_engine.has_pending_saves()
    (second,) = llm.generate([{"prompt_token_ids": prompt + answer + [9, 9, 9]}], greedy(4), use_tqdm=False)
    # decode computed tokens up to 40 + 29; the last boundary it crossed is 64
    assert second.num_cached_tokens == 64


def test_prompt_end_anchor_and_rung_hits(model_dir):
    llm = make_llm(model_dir, state_checkpoint_interval=64)
    prompt = random_prompts([140], 320, seed=4)[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy(1), use_tqdm=False)
    filed = llm.get_metrics()["checkpoints"]["filed"]
    assert filed["rung"] == 1 and filed["prompt_end"] == 1  # the rung at 64; 128 is both, filed as the anchor
    (extended,) = llm.generate([{"prompt_token_ids": prompt + [5] * 10}], greedy(1), use_tqdm=False)
    assert extended.num_cached_tokens == 128
    (diverging,) = llm.generate([{"prompt_token_ids": prompt[:70] + [6] * 70}], greedy(1), use_tqdm=False)
    assert diverging.num_cached_tokens == 64  # the rung at 64


def test_demand_checkpoint_hit(model_dir):
    llm = make_llm(model_dir, state_checkpoint_interval=1024)
    shared = random_prompts([100], 320, seed=5)[0]
    tails = random_prompts([40, 40, 40], 320, seed=6)
    llm.generate([{"prompt_token_ids": shared + tails[0]}], greedy(1), use_tqdm=False)  # anchor at 128 only
    (b,) = llm.generate([{"prompt_token_ids": shared + tails[1]}], greedy(1), use_tqdm=False)
    assert b.num_cached_tokens == 0  # KV of [0, 96) is cached but there is no checkpoint at the grid point 64
    assert llm.get_metrics()["prefix_cache"]["tokens_lost_to_missing_checkpoint"] == 96
    (c,) = llm.generate([{"prompt_token_ids": shared + tails[2]}], greedy(1), use_tqdm=False)
    assert c.num_cached_tokens == 64 and llm.get_metrics()["checkpoints"]["filed"]["demand"] == 1


def test_small_cache_eviction_keeps_outputs_and_frees_everything(model_dir):
    roomy = make_llm(model_dir, state_checkpoint_interval=64)
    small = make_llm(model_dir, state_checkpoint_interval=64, num_kv_blocks=40, max_num_seqs=4)
    got, ref = run_sessions(small, num_sessions=4), run_sessions(roomy, num_sessions=4)
    for turn_got, turn_ref in zip(got, ref, strict=True):
        for a, b in zip(turn_got, turn_ref, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert small.get_metrics()["kv_cache"]["evicted_blocks"] > 0
    assert_nothing_held(small)


def test_aborts_free_blocks_slots_and_pins(model_dir):
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    prompts = random_prompts([30, 60, 90], 320, seed=7)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(50))
    for _ in range(3):
        engine.step()
    engine.abort_request(["r0", "r1", "r2"])
    assert_nothing_held(llm)


def test_prefix_caching_without_room_for_a_checkpoint_is_refused_at_startup():
    with pytest.raises(ValueError, match="state_checkpoint_fraction=0.0"):
        LLM(model="random:tiny", device="cpu", dtype="float32", state_checkpoint_fraction=0.0)
    llm = LLM(model="random:tiny", device="cpu", dtype="float32", state_checkpoint_fraction=0.0,
              enable_prefix_caching=False)
    assert llm.llm_engine.core.prefix_cache is None


def test_duplicates_in_flight_are_registered_and_outputs_stay_equal(model_dir):
    """Identical prompts admitted together compute the same blocks twice: the second copies are
    registered as duplicates, and the invariants hold after every step, under eviction too."""
    prompts = random_prompts([70, 70, 45], 320, seed=11)
    prompts[1] = list(prompts[0])
    reference = make_llm(model_dir, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False)
    llm = make_llm(model_dir, state_checkpoint_interval=64, num_kv_blocks=24, max_num_seqs=4)
    engine = llm.llm_engine
    for round_ in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", {"prompt_token_ids": p}, greedy(20))
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            engine.scheduler.check_invariants()
        assert [outputs[f"{round_}-{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in reference]
    assert engine.scheduler.kv_cache_manager.pool._duplicates == {}  # released with their requests
    assert_nothing_held(llm)


def test_a_kv_cache_smaller_than_the_context_caps_max_model_len(model_dir):
    """num_kv_blocks=8 holds 128 tokens: longer prompts are refused at admission and generation stops
    at the cap, instead of waiting forever for blocks that do not exist."""
    llm = make_llm(model_dir, num_kv_blocks=8)
    assert llm.llm_engine.core.max_model_len == 8 * BS
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([{"prompt_token_ids": random_prompts([200], 320, seed=9)[0]}], greedy(), use_tqdm=False)
    (out,) = llm.generate([{"prompt_token_ids": random_prompts([120], 320, seed=9)[0]}], greedy(30), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert_nothing_held(llm)


def test_checkpoints_are_captured_inside_a_chunk(model_dir):
    """A 300-token prompt with rungs every 64 tokens runs as one forward pass (its first step samples), its
    rungs and prompt-end anchor captured inside that chunk; a prompt sharing 200 of its tokens resumes
    from the rung at 192 with the tokens of an engine without caching."""
    on = make_llm(model_dir, state_checkpoint_interval=64, max_num_batched_tokens=512)
    first, tail = random_prompts([300, 40], 320, seed=7)
    engine = on.llm_engine
    engine.add_request("a", {"prompt_token_ids": first}, greedy(4))
    outputs = engine.step()
    assert [o.request_id for o in outputs if o.outputs[0].token_ids] == ["a"]  # one pass before the first token
    filed = on.get_metrics()["checkpoints"]["filed"]
    assert filed.get("rung", 0) == 3 and filed.get("prompt_end", 0) == 1, filed  # rungs 64, 128, 192; anchor 256
    while engine.has_unfinished_requests():
        engine.step()
    second = first[:200] + tail
    got = on.generate({"prompt_token_ids": second}, greedy(), use_tqdm=False)[0]
    assert got.num_cached_tokens == 192
    off = make_llm(model_dir, enable_prefix_caching=False)
    want = off.generate({"prompt_token_ids": second}, greedy(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert_nothing_held(on)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_checkpoints_captured_inside_a_chunk(model_dir):
    """On the GPU the rounds run fla's chunked kernel: a prompt resuming from a rung captured inside a
    chunk gives the tokens of an engine without caching."""
    cuda = {"dtype": "float32", "device": "cuda", "block_size": BS, "cache_memory": "64MiB"}
    on = LLM(model=model_dir, **cuda, state_checkpoint_interval=64, max_num_batched_tokens=512)
    first, tail = random_prompts([300, 40], 320, seed=7)
    on.generate({"prompt_token_ids": first}, greedy(4), use_tqdm=False)
    second = first[:200] + tail
    got = on.generate({"prompt_token_ids": second}, greedy(), use_tqdm=False)[0]
    assert got.num_cached_tokens == 192
    on.llm_engine.shutdown()
    off = LLM(model=model_dir, **cuda, enable_prefix_caching=False)
    want = off.generate({"prompt_token_ids": second}, greedy(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
