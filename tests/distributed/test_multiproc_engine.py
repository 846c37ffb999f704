"""The multi-process executor through `LLM`: TP=2 (with and without async scheduling), TP=2 with
expert parallelism, PP=2, TP=2 x PP=2, PP=3 uneven, and TP=1 in a rank process, all equal to the
single-process engine (greedy tokens identical, logprobs within 1e-4).

Each world is one module-scoped engine (its rank processes start once and are stopped by the fixture)
and runs the same scenarios as a single-process reference on the same float32 checkpoint: a batch with
chunked prefill, prefix caching and preemption (few KV blocks), a multi-turn follow-up that resumes from
a KDA checkpoint, and an abort with batches in flight. Also here: the refusals (a stage without a KDA
layer, async scheduling under PP, experts that do not split over the TP ranks), and a killed rank
taking the engine down with an error naming it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.config.engine_config import EngineConfig
from deltaserve.executor.multiproc import RankFailedError

COMMON = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, num_kv_blocks=18, block_size=16,
              max_num_seqs=4)
# name -> (model, engine options): inflight 1, 2 and more than the stage count are all covered
WORLDS = {
    "tp2": ("four_layers", dict(tensor_parallel_size=2)),
    "pp2_inflight1": ("four_layers", dict(pipeline_parallel_size=2, pp_max_inflight=1)),
    "tp2_pp2": ("four_layers", dict(tensor_parallel_size=2, pipeline_parallel_size=2, pp_max_inflight=2)),
    "pp3_uneven_inflight4": ("five_layers", dict(pipeline_parallel_size=3, pp_max_inflight=4)),
    "mp_tp1": ("four_layers", dict(distributed_executor_backend="mp")),
    # two steps in flight, decodes on placeholders that every TP rank fills from its own sample
    "tp2_async": ("four_layers", dict(tensor_parallel_size=2, async_scheduling=True)),
    # each TP rank holds 4 of the 8 routed experts whole (tiny_hub_config: num_experts=8)
    "tp2_ep": ("four_layers", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    four, _ = checkpoint_dir(tmp_path_factory, "mp4", tiny_hub_config(), seed=31)
    # KDA, KDA, MLA, KDA, KDA: PP=3 splits it [0, 2), [2, 4), [4, 5), a KDA layer on every stage
    five_config = tiny_hub_config(num_hidden_layers=5, linear_attn_config=dict(
        head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 4, 5], full_attn_layers=[3]))
    five, _ = checkpoint_dir(tmp_path_factory, "mp5", five_config, seed=37)
    return {"four_layers": four, "five_layers": five}


def _batch_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=36, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, ignore_eos=True),
    ]


def _completion(output) -> tuple[list[int], list[dict[int, float]] | None]:
    c = output.outputs[0]
    lps = None if c.logprobs is None else [{t: v.logprob for t, v in d.items()} for d in c.logprobs]
    return list(c.token_ids), lps


def run_scenarios(llm: LLM) -> dict:
    """The same work on any engine; returns what to compare."""
    results: dict = {}
    params = _batch_params()
    # a conversation: its second turn resumes from a checkpoint of the first
    first_turn = random_prompts([70], 320, seed=8)[0]
    first = llm.generate({"prompt_token_ids": first_turn}, params[0], use_tqdm=False)[0]
    results["turn1"] = _completion(first)
    turn2 = first_turn + results["turn1"][0] + [5, 6, 7]
    second = llm.generate({"prompt_token_ids": turn2}, params[0], use_tqdm=False)[0]
    results["turn2"] = _completion(second)
    results["turn2_cached"] = second.num_cached_tokens

    # more than the KV blocks hold at once: preemption
    prompts = random_prompts([40, 52, 33, 61, 7, 90], 320, seed=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
    results["batch"] = [_completion(o) for o in outs]
    metrics = llm.get_metrics()
    results["preemptions"] = metrics["scheduler"]["num_preemptions"]
    results["max_in_flight"] = metrics["executor"]["max_batches_in_flight"]

    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(random_prompts([30, 12, 50], 320, seed=4)):
        engine.add_request(f"abort{i}", {"prompt_token_ids": p}, greedy)
    got: dict[str, list[int]] = {}
    for step in range(400):
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
        if step == 5:
            engine.abort_request(["abort1"])
        if not engine.has_unfinished_requests():
            break
    results["abort"] = got
    scheduler = engine.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == engine.cache_plan.num_blocks
    assert scheduler.state_pool.num_free == engine.cache_plan.num_state_slots
    assert scheduler.prefix_cache.checkpoints.num_pinned == 0
    scheduler.check_invariants()
    return results


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, dict]:
    return {name: run_scenarios(LLM(model=path, **COMMON)) for name, path in model_dirs.items()}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, model_dirs) -> Iterator[tuple[str, dict, dict]]:
    model, options = WORLDS[request.param]
    llm = LLM(model=model_dirs[model], **COMMON, **options)
    try:
        pids = llm.llm_engine.executor.rank_pids()
        yield model, options, run_scenarios(llm)
    finally:
        llm.shutdown()
    assert not any(_alive(pid) for pid in pids), "every rank process must be stopped"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped) counts as stopped
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _assert_same(got: tuple, want: tuple, what: str) -> None:
    assert got[0] == want[0], f"{what}: tokens differ"
    if want[1] is None:
        assert got[1] is None, what
        return
    for pos, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        assert a.keys() == b.keys(), f"{what} position {pos}: logprob ids differ"
        diff = max(abs(a[t] - b[t]) for t in a)
        assert diff < LOGPROB_TOL, f"{what} position {pos}: logprobs differ by {diff:.2e}"


def test_world_equals_single_process(world, references):
    model, options, got = world
    want = references[model]
    # the batch queue fills the pipeline: up to pp_max_inflight batches (0: one per stage)
    stages = options.get("pipeline_parallel_size", 1)
    expected = 2 if options.get("async_scheduling") else options.get("pp_max_inflight") or stages
    assert got["max_in_flight"] == expected
    assert want["preemptions"] > 0 and got["preemptions"] > 0, "the batch must preempt"
    for i, (g, w) in enumerate(zip(got["batch"], want["batch"], strict=True)):
        _assert_same(g, w, f"batch request {i}")
    _assert_same(got["turn1"], want["turn1"], "first turn")
    _assert_same(got["turn2"], want["turn2"], "second turn")
    assert got["turn2_cached"] > 0 and want["turn2_cached"] > 0, "the second turn must hit the prefix cache"
    assert got["abort"]["abort0"] == want["abort"]["abort0"] and len(want["abort"]["abort0"]) == 12
    assert got["abort"]["abort2"] == want["abort"]["abort2"]
    a, b = got["abort"].get("abort1", []), want["abort"].get("abort1", [])
    assert a[: len(b)] == b[: len(a)], "the aborted request's tokens before the abort agree"


def test_stage_without_kda_layer_is_refused(model_dirs):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 leaves no KDA layer on stage 2 "
                                         r"\(layers \[2, 3\), 1 MLA\).*choose pipeline_parallel_size from \[1, 2\]"):
        LLM(model=model_dirs["four_layers"], **COMMON, pipeline_parallel_size=4)


def test_experts_that_do_not_split_over_tp_are_refused_before_ranks_start(model_dirs):
    # refused by the engine before any rank process starts (a TP of 3 would fail on the heads later)
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible by tensor_parallel_size=3: with "
                                         r"enable_expert_parallel.*choose a tensor_parallel_size that divides"):
        LLM(model=model_dirs["four_layers"], **COMMON, tensor_parallel_size=3, enable_expert_parallel=True)
    assert EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True).parallel.expert_parallel_size == 2
    assert not EngineConfig(enable_expert_parallel=True).parallel.uses_expert_parallel  # TP=1: no effect


def test_async_scheduling_under_pp_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"async_scheduling=True .* pipeline_parallel_size=2.*set "
                                         r"async_scheduling=False .* or pipeline_parallel_size=1"):
        EngineConfig(pipeline_parallel_size=2, async_scheduling=True)
    assert EngineConfig(pipeline_parallel_size=2).resolve_async_scheduling("cuda") is False
    assert EngineConfig(tensor_parallel_size=2).executor_backend == "mp"
    with pytest.raises(ValueError, match="distributed_executor_backend='uniproc' runs one rank"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uniproc")
    with pytest.raises(ValueError, match="pp_max_inflight=2 needs pipeline_parallel_size > 1"):
        EngineConfig(pp_max_inflight=2)


def test_killed_rank_stops_the_engine_naming_it(model_dirs):
    llm = LLM(model=model_dirs["four_layers"], **COMMON, pipeline_parallel_size=2)
    executor = llm.llm_engine.executor
    pids = executor.rank_pids()
    try:
        engine = llm.llm_engine
        for i, p in enumerate(random_prompts([60, 45], 320, seed=2)):
            engine.add_request(f"k{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=50))
        engine.step()
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pp_rank 1, tp_rank 0, pid \d+\) died: exit code -9 "
                                                  r"\(killed by SIGKILL\)"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - started < 10
        assert not any(_alive(pid) for pid in pids), "the other ranks are stopped with it"
        with pytest.raises(RankFailedError, match="stopped earlier: rank 1"):
            engine.step()
    finally:
        llm.shutdown()


def test_a_rank_refuses_a_stage_spec_other_than_its_own():
    from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
    from deltaserve.executor.rank_process import RankReady, _check_checkpoint_spec

    mine = KDAStateSpec(num_layers=1, num_heads=4, head_k_dim=16, head_v_dim=16, conv_dim=192, conv_window=3,
                        conv_dtype_bytes=4)
    ready = RankReady(3, 1, 1, 0, (2, 4), MLALatentSpec(16, 1, 40, 4), mine, 1 << 20, "cpu", "float32")
    other = KDAStateSpec(num_layers=2, num_heads=4, head_k_dim=16, head_v_dim=16, conv_dim=192, conv_window=3,
                         conv_dtype_bytes=4)
    joint = _check_checkpoint_spec(ready, [other, mine], unit_bytes=4096)
    assert joint.units_per_checkpoint == 4 and joint.total_image_bytes == 3 * 6400
    bf16 = KDAStateSpec(num_layers=1, num_heads=4, head_k_dim=16, head_v_dim=16, conv_dim=192, conv_window=3,
                        conv_dtype_bytes=2)
    with pytest.raises(ValueError, match=r"rank 3 \(pipeline stage 1\) holds KDA state"):
        _check_checkpoint_spec(ready, [other, bf16], unit_bytes=4096)
