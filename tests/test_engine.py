"""Engine behaviour on the tiny random model: batching, preemption, validation, aborts, sampling."""

from __future__ import annotations

import json
import shutil

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out, _ = checkpoint_dir(tmp_path_factory, "engine", tiny_hub_config(), seed=21)
    return out


def make_llm(model_dir: str, **options) -> LLM:
    options.setdefault("dtype", "float32")
    options.setdefault("device", "cpu")
    return LLM(model=model_dir, **options)


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    scheduler = engine.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == engine.cache_plan.num_blocks
    assert scheduler.state_pool.num_free == engine.cache_plan.num_state_slots


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_independence(model_dir):
    prompts = random_prompts([1, 3, 9, 17, 31, 40, 55, 64, 70, 2, 5, 90, 100, 16, 33, 48], 320, seed=5)
    llm = make_llm(model_dir, max_num_batched_tokens=128)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.num_cached_tokens for o in batched] == [0] * len(prompts)  # a cold cache: all computed
    # each prompt alone, on an engine of its own with prefix caching off: nothing the batched run left
    # behind can serve it (on `llm` itself, half of them resumed from the batch's checkpoints)
    solo = make_llm(model_dir, enable_prefix_caching=False)
    alone = [solo.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in alone] == [0] * len(prompts)
    assert token_ids(batched) == token_ids(alone)
    # the batch again: prompts now resume from the first run's checkpoints, and still match the cold runs
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert any(o.num_cached_tokens > 0 for o in again)
    assert token_ids(again) == token_ids(alone)
    assert_nothing_held(llm)
    assert_nothing_held(solo)


def test_preemption_gives_same_outputs_as_roomy_cache(model_dir):
    prompts = random_prompts([40, 52, 61, 33, 47, 58], 320, seed=6)
    params = greedy(40)
    roomy = make_llm(model_dir).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # 6 requests of up to 101 tokens need 42 blocks of 16; 16 blocks force preemptions
    small = make_llm(model_dir, num_kv_blocks=16, max_num_batched_tokens=64)
    tight = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert_nothing_held(small)


def test_state_slots_limit_concurrency(model_dir):
    prompts = random_prompts([10, 20, 30, 40, 50], 320, seed=7)
    llm = make_llm(model_dir, max_num_seqs=2)
    ref = make_llm(model_dir).generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ({"prompt_token_ids": [5, 999999]}, None, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [5, -1]}, None, "prompt_token_ids[1]"),
        ({"prompt_token_ids": []}, None, "empty"),
        ({"prompt_token_ids": [5] * 5000}, None, "max_model_len"),
        ({"prompt_token_ids": [5]}, SamplingParams(logprobs=20, max_tokens=1), None),
    ],
)
def test_bad_requests_fail_alone(model_dir, prompt, params, field):
    llm = make_llm(model_dir, max_model_len=4096)
    engine = llm.llm_engine
    engine.add_request("good", {"prompt_token_ids": [7, 8, 9]}, greedy(8))
    engine.step()
    if field is None:  # a valid edge case: accepted
        engine.add_request("edge", prompt, params)
    else:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            engine.add_request("bad", prompt, params or greedy())
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert len(outputs["good"].outputs[0].token_ids) == 8
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_generate_validates_all_prompts_before_running(model_dir):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [10**7]}], greedy(), use_tqdm=False)
    assert_nothing_held(llm)


def test_abort_frees_everything(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    engine = llm.llm_engine
    for i, p in enumerate(random_prompts([50, 60, 70, 80], 320, seed=8)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(30))
    for _ in range(3):
        engine.step()
    engine.abort_request(["r0", "r2"])
    engine.step()
    engine.abort_request(["r1", "r3", "unknown"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir):
    llm = make_llm(model_dir)
    prompts = random_prompts([12, 25, 3], 320, seed=9)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # alone on a fresh engine with prefix caching off, so it cannot resume from `together`'s checkpoint
    solo = make_llm(model_dir, enable_prefix_caching=False)
    alone = solo.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    assert alone.num_cached_tokens == 0
    assert alone.outputs[0].token_ids == together[1].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    different = solo.generate({"prompt_token_ids": prompts[1]}, other_seed, use_tqdm=False)[0]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def with_eos(model_dir: str, out_dir, eos_token_id: int) -> str:
    """A copy of the checkpoint whose config files name `eos_token_id` as its only EOS."""
    out = shutil.copytree(model_dir, out_dir)
    for name in ("config.json", "generation_config.json"):
        if (out / name).is_file():
            config = json.loads((out / name).read_text())
            config["eos_token_id"] = eos_token_id
            (out / name).write_text(json.dumps(config))
    return str(out)


def test_stop_token_ids_and_eos(model_dir, tmp_path):
    llm = make_llm(model_dir)
    prompt = random_prompts([20], 320, seed=10)[0]
    free = llm.generate({"prompt_token_ids": prompt}, greedy(20), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert_nothing_held(llm)
    # the same id as the checkpoint's EOS: greedy decoding ends there unless ignore_eos
    eos_llm = make_llm(with_eos(model_dir, tmp_path / "eos", stop_id))
    assert eos_llm.llm_engine.eos_token_ids == (stop_id,)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    ended = eos_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert ended.token_ids == free.token_ids[: first + 1]
    assert ended.finish_reason == "stop" and ended.stop_reason is None
    ignored = eos_llm.generate({"prompt_token_ids": prompt}, greedy(20), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
    assert_nothing_held(eos_llm)
