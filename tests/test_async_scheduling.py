"""Async scheduling (two steps in flight, decodes on placeholders) gives exactly the synchronous outputs.

On the CPU a step runs inside the call that launches it, so nothing overlaps here; what these tests
check is the bookkeeping: placeholders, late samples of finished or preempted requests, end-of-sequence
checkpoints filed while a step is in flight, and that nothing leaks.
"""

from __future__ import annotations

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out, _ = checkpoint_dir(tmp_path_factory, "async", tiny_hub_config(), seed=23)
    return out


def make_llm(model_dir: str, async_scheduling: bool, **options) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling, **options)


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded sampling and logprobs, with lengths that end at different steps."""
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
    ]


def outputs_of(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = None if c.logprobs is None else [{t: round(v.logprob, 5) for t, v in d.items()} for d in c.logprobs]
        result.append((c.token_ids, c.finish_reason, lps))
    return result


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    scheduler = engine.scheduler
    assert not engine.core.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == engine.cache_plan.num_blocks
    assert scheduler.state_pool.num_free == engine.cache_plan.num_state_slots
    if scheduler.prefix_cache is not None:
        assert scheduler.prefix_cache.checkpoints.num_pinned == 0
    scheduler.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_async_equals_sync_with_chunked_prefill(model_dir, caching):
    prompts = random_prompts([3, 70, 17, 130, 1, 45, 64, 9], 320, seed=3)
    results = {}
    for mode in (False, True):
        llm = make_llm(model_dir, mode, max_num_batched_tokens=48, enable_prefix_caching=caching)
        assert llm.llm_engine.core.batch_queue_size == (2 if mode else 1)
        results[mode] = outputs_of(llm, prompts, mixed_params())
        results[mode, "again"] = outputs_of(llm, prompts, mixed_params())  # with caching: from checkpoints
        assert_nothing_held(llm)
    assert results[True] == results[False]
    assert results[True, "again"] == results[False, "again"]
    # resumed from checkpoints, chunked differently: the same tokens, logprobs equal to float rounding
    assert [r[:2] for r in results[True, "again"]] == [r[:2] for r in results[False]]


def test_async_equals_sync_under_preemption(model_dir):
    prompts = random_prompts([40, 52, 33, 61, 47, 38], 320, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=36, ignore_eos=True)]
    results = {}
    for mode in (False, True):
        llm = make_llm(model_dir, mode, num_kv_blocks=22, block_size=16, max_num_batched_tokens=64)
        results[mode] = outputs_of(llm, prompts, params)
        assert llm.llm_engine.scheduler.num_preemptions_total > 0, "the workload must preempt"
        assert_nothing_held(llm)
    assert results[True] == results[False]


def test_stops_inside_the_run_ahead_end_at_the_right_token(model_dir):
    prompt = random_prompts([25], 320, seed=12)[0]
    free = make_llm(model_dir, False).generate({"prompt_token_ids": prompt},
                                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                               use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token seen first at i
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[free[stop_at]])
    for mode in (False, True):
        llm = make_llm(model_dir, mode)
        out = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [free[: stop_at + 1]] * 2
        assert [o.outputs[0].finish_reason for o in out] == ["stop", "stop"]
        assert_nothing_held(llm)


def test_aborts_with_steps_in_flight(model_dir):
    prompts = random_prompts([30, 12, 50, 7], 320, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for mode in (False, True):
        llm = make_llm(model_dir, mode, max_num_batched_tokens=32)
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        got: dict[str, list[int]] = {}
        for step in range(200):
            for out in engine.step():
                got[out.request_id] = out.outputs[0].token_ids
            engine.scheduler.check_invariants()
            if step == 6:
                engine.abort_request(["r1", "r2"])
            if not engine.has_unfinished_requests():
                break
        tokens[mode] = got
        assert_nothing_held(llm)
    for rid in ("r0", "r3"):
        assert tokens[True][rid] == tokens[False][rid] and len(tokens[True][rid]) == 20
    for rid in ("r1", "r2"):  # cut at a step: only what both saw is comparable
        a, b = tokens[True].get(rid, []), tokens[False].get(rid, [])
        assert a[: len(b)] == b[: len(a)]


def test_next_turn_hits_the_end_of_sequence_checkpoint(model_dir):
    """An agentic next turn resumes from the first turn's end-of-sequence checkpoint, filed while the
    step that ran ahead on the finished request was still in flight."""
    prompt = random_prompts([150], 320, seed=8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    cached = {}
    for mode in (False, True):
        llm = make_llm(model_dir, mode, state_checkpoint_interval=1024)  # no rungs inside the turn
        first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        turn2 = prompt + list(first.outputs[0].token_ids) + [5, 6, 7]
        second = llm.generate({"prompt_token_ids": turn2}, params, use_tqdm=False)[0]
        cached[mode] = second.num_cached_tokens
        assert_nothing_held(llm)
    assert cached[False] > len(prompt) and cached[True] >= cached[False]


def test_async_scheduling_option():
    from deltaserve.config.engine_config import EngineConfig

    assert EngineConfig().resolve_async_scheduling("cuda") is True
    assert EngineConfig().resolve_async_scheduling("cpu") is False
    assert EngineConfig(async_scheduling=False).resolve_async_scheduling("cuda") is False
    assert EngineConfig(async_scheduling=True).resolve_async_scheduling("cpu") is True
