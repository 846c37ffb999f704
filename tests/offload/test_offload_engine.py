"""The offload tier through the whole engine (CPU, float32, the tiny random model).

Multi-turn sessions whose KV and KDA state no longer fit in HBM (few KV blocks, room for a handful of
checkpoints): with the tier on, evicted prefixes come back from host memory, disk or a Mooncake
Store, and greedy tokens and logprobs equal an engine without prefix caching. Also: a corrupt disk
tier (every load fails and is recomputed), a Mooncake master stopped mid-run (the tier degrades,
outputs unchanged), PP=2 over gloo (each stage's objects under its own worker id, the index charged
the largest stage's image), and nothing held afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.offload.objects import rank_object_bytes
from offload.mooncake_master import MASTER_BINARY, Master

COMMON = dict(dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=96, state_checkpoint_interval=64)
# little HBM: 60 blocks of KV (960 tokens) for 6 sessions of up to ~500 tokens, a few checkpoints
SMALL_HBM = dict(num_kv_blocks=60, max_num_seqs=4, state_checkpoint_fraction=0.001)
TIER = dict(kv_offloading_chunk_size=64)
SESSIONS, TURNS = 6, 4
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = checkpoint_dir(tmp_path_factory, "offload", tiny_hub_config(), seed=41)
    return path


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def run_sessions(llm: LLM, between_turns=None) -> list:
    """Sessions sharing a system prompt, each turn the previous prompt + answer + a new message; the
    turns of all sessions in one generate call per round. `between_turns(turn)` runs after each round."""
    system = random_prompts([70], 320, seed=1)[0]
    messages = random_prompts([5 + 9 * i for i in range(SESSIONS * (TURNS + 1))], 320, seed=2)
    prompts = [system + messages[s] for s in range(SESSIONS)]
    results = []
    for turn in range(TURNS):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        results.append(outs)
        if between_turns is not None:
            between_turns(turn)
        prompts = [p + o.outputs[0].token_ids + messages[(turn + 1) * SESSIONS + s]
                   for s, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    return results


def assert_same(got: list, want: list) -> None:
    for turn_got, turn_want in zip(got, want, strict=True):
        for a, b in zip(turn_got, turn_want, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
                assert abs(la[t].logprob - lb[t].logprob) < LOGPROB_TOL


def assert_nothing_held(llm: LLM) -> None:
    core = llm.llm_engine.core
    s = core.scheduler
    assert not s.has_unfinished_requests() and not s.tier_waiting and not s.has_pending_saves
    assert s.kv_cache_manager.num_free_blocks == core.cache_plan.num_blocks
    assert s.state_pool.num_free == core.cache_plan.num_state_slots
    assert all(cp.pins == 0 for cp in core.prefix_cache.checkpoints._lru.values())
    s.check_invariants()


@pytest.fixture(scope="module")
def reference(model_dir) -> list:
    llm = LLM(model=model_dir, enable_prefix_caching=False, **COMMON)
    try:
        return run_sessions(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def hbm_only(model_dir) -> dict:
    """The same small HBM without the tier: what it hits on its own."""
    llm = LLM(model=model_dir, **COMMON, **SMALL_HBM)
    try:
        outs = run_sessions(llm)
        return {"outputs": outs, "hit_tokens": llm.get_metrics()["prefix_cache"]["hit_tokens"],
                "evicted": llm.get_metrics()["checkpoints"]["evicted"]}
    finally:
        llm.shutdown()


def tier_options(kind: str, tmp_path: Path) -> dict:
    if kind == "host":
        return dict(kv_offloading_size="64MiB")
    if kind == "disk":
        return dict(kv_offloading_disk_path=str(tmp_path / "tier"), kv_offloading_disk_size="64MiB")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_outputs_identical_with_the_tier_and_evicted_prefixes_come_back(kind, model_dir, tmp_path, reference,
                                                                       hbm_only):
    llm = LLM(model=model_dir, **COMMON, **SMALL_HBM, **TIER, **tier_options(kind, tmp_path))
    try:
        got = run_sessions(llm)
        assert_same(got, reference)
        assert_same(hbm_only["outputs"], reference)
        metrics = llm.get_metrics()
        offload = metrics["offload"]
        assert sum(hbm_only["evicted"].values()) > 0, "the workload must evict checkpoints from HBM"
        assert offload["loads_done"] > 0 and offload["loads_failed"] == 0
        assert offload["saves_done"] > 0 and offload["pending_saves"] == 0
        assert metrics["prefix_cache"]["hit_tokens"] > hbm_only["hit_tokens"]
        tier = offload["tiers"][kind]
        assert tier["hits"] > 0 and tier["stored_bytes"] > 0 and tier["corrupt_objects"] == 0
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_a_corrupt_disk_tier_is_a_miss_and_the_prompt_is_recomputed(model_dir, tmp_path, reference):
    root = tmp_path / "tier"

    def damage(turn: int) -> None:
        for path in root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2])  # truncated: the checksum and length cannot match

    llm = LLM(model=model_dir, **COMMON, **SMALL_HBM, **TIER, kv_offloading_disk_path=str(root),
              kv_offloading_disk_size="64MiB")
    try:
        got = run_sessions(llm, between_turns=damage)
        assert_same(got, reference)
        offload = llm.get_metrics()["offload"]
        assert offload["loads_failed"] > 0
        assert offload["tiers"]["disk"]["corrupt_objects"] > 0
        assert offload["index"]["forgotten"] > 0
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


@pytest.mark.skipif(MASTER_BINARY is None, reason="mooncake_master (mooncake-transfer-engine-non-cuda) not found")
def test_mooncake_store_tier_and_a_master_stopped_mid_run(model_dir, tmp_path, reference):
    master = Master(tmp_path / "master.log")
    master.start()
    try:
        llm = LLM(model=model_dir, **COMMON, **SMALL_HBM, **TIER, kv_offloading_remote=master.url)
        try:
            # three turns with the store up (the third loads from it), then it is gone for the fourth
            got = run_sessions(llm, between_turns=lambda turn: master.stop() if turn == 2 else None)
            assert_same(got, reference)
            offload = llm.get_metrics()["offload"]
            store = offload["tiers"]["mooncake"]
            assert store["hits"] > 0 and offload["loads_done"] > 0
            assert store["failures"] > 0 and store["degraded"] == 1
            assert_nothing_held(llm)
        finally:
            llm.shutdown()
    finally:
        master.stop()


def test_pipeline_parallel_stages_keep_their_own_objects(model_dir, tmp_path, reference):
    root = tmp_path / "tier"
    llm = LLM(model=model_dir, **COMMON, **SMALL_HBM, **TIER, pipeline_parallel_size=2,
              kv_offloading_disk_path=str(root), kv_offloading_disk_size="64MiB")
    try:
        got = run_sessions(llm)
        assert_same(got, reference)
        core = llm.llm_engine.core
        offload = llm.get_metrics()["offload"]
        assert offload["loads_done"] > 0 and offload["loads_failed"] == 0
        # each stage stores under its own worker id: one directory each, the same objects in both
        stages = sorted(p.name for p in root.iterdir())
        assert stages == ["pp0of2-tp0of1-dcp0of1", "pp1of2-tp0of1-dcp0of1"]
        counts = [sum(1 for f in (root / s).rglob("*") if f.is_file()) for s in stages]
        assert counts[0] == counts[1] > 0
        # the head's index charges every image the largest stage's size
        images = [state.bytes_per_image for _, state in core.stage_specs]
        assert len(set(images)) > 1, "the tiny model's two stages hold different numbers of KDA layers"
        assert core.offload.index.state_image_bytes == rank_object_bytes(max(images))
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_decode_context_parallel_ranks_store_their_stripes(model_dir, reference):
    """TP=2 x DCP=2 (gloo): each rank stores its stripe of every KV chunk under its own DCP id; outputs
    equal the reference and loads come back on both ranks."""
    llm = LLM(model=model_dir, **COMMON, **TIER, tensor_parallel_size=2, decode_context_parallel_size=2,
              num_kv_blocks=30, max_num_seqs=4, state_checkpoint_fraction=0.001, kv_offloading_size="64MiB")
    try:
        assert_same(run_sessions(llm), reference)
        offload = llm.get_metrics()["offload"]
        assert offload["loads_done"] > 0 and offload["loads_failed"] == 0
        assert offload["ranks"]["loads_done"] == 2 * offload["loads_done"]  # both ranks loaded each hit
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_offload_options_are_checked_at_startup(tmp_path):
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(model="random:tiny", device="cpu", kv_offloading_size="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_chunk_size=24 must be a positive multiple of the block"):
        LLM(model="random:tiny", device="cpu", kv_offloading_size="1GiB", kv_offloading_chunk_size=24)
    with pytest.raises(ValueError, match="go together"):
        LLM(model="random:tiny", device="cpu", kv_offloading_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="mooncake://MASTER_HOST:RPC_PORT"):
        LLM(model="random:tiny", device="cpu", kv_offloading_remote="http://nowhere")
    with pytest.raises(ValueError, match="kv_offloading_size='lots' is not a size"):
        LLM(model="random:tiny", device="cpu", kv_offloading_size="lots")
    with pytest.raises(ValueError, match="kv_offloading_chunk_size=256"):  # the interval must sit on the chunk grid
        LLM(model="random:tiny", device="cpu", kv_offloading_size="1GiB", state_checkpoint_interval=64)
    assert not os.listdir(tmp_path)


@pytest.mark.skipif(MASTER_BINARY is None, reason="Mooncake (mooncake-transfer-engine-non-cuda) not installed")
def test_the_tier_beside_a_pd_connector_on_one_prefill_server(model_dir, tmp_path):
    """A P/D producer that also offloads: its prefills hit the tier once HBM evicted them, and the
    consumer decoding from what it transferred gives the colocated engine's tokens."""
    from kv_transfer.test_pd_engine import _decode, _prefill, _settle

    transfer = {"kv_connector": "MooncakeConnector"}
    reference = LLM(model=model_dir, enable_prefix_caching=False, **COMMON)
    # room for every session's prompt held for its consumer at once; checkpoints still few
    producer = LLM(model=model_dir, **COMMON, **TIER, num_kv_blocks=110, max_num_seqs=SESSIONS,
                   state_checkpoint_fraction=0.001, kv_offloading_size="64MiB",
                   kv_transfer_config={**transfer, "kv_role": "kv_producer", "transfer_timeout_s": 20})
    consumer = LLM(model=model_dir, **COMMON, kv_transfer_config={**transfer, "kv_role": "kv_consumer"})
    try:
        system = random_prompts([70], 320, seed=1)[0]
        messages = random_prompts([5 + 9 * i for i in range(SESSIONS * 4)], 320, seed=3)
        prompts = [system + messages[s] for s in range(SESSIONS)]
        for turn in range(3):
            want = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
            got = _decode(consumer, prompts, _prefill(producer, prompts), 6)
            _settle(producer, consumer)
            for g, w in zip(got, want, strict=True):
                assert g.outputs[0].token_ids == w.outputs[0].token_ids
            prompts = [p + w.outputs[0].token_ids + messages[(turn + 1) * SESSIONS + s]
                       for s, (p, w) in enumerate(zip(prompts, want, strict=True))]
        offload = producer.get_metrics()["offload"]
        assert offload["loads_done"] > 0 and offload["saves_done"] > 0
        assert_nothing_held(producer)
    finally:
        for llm in (reference, producer, consumer):
            llm.shutdown()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_tier_gives_what_a_roomy_hbm_cache_gives(model_dir):
    """On a GPU: saves copy on the compute stream behind the producer fence, loads queue before the
    forward. Against a GPU engine whose HBM holds every prefix (the same hits, from HBM), the tier's
    tokens agree, parting only at a near-tie. (Both drift alike from the CPU: fla's float32 kernels
    resumed from a checkpoint differ from one long prefill, up to 0.34 in a logprob on this model,
    benchmarks/gpu_checks/offload_logprob_drift.py; the bytes a load writes are checked exactly by
    test_rank_store's CUDA round trip.) Each turn's prompts are fixed from the roomy engine's answers."""
    from test_parity import first_divergence

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    on_gpu = {**COMMON, "device": "cuda", "cache_memory": "64MiB", "enforce_eager": True}
    roomy = LLM(model=model_dir, **on_gpu)
    tier = LLM(model=model_dir, **on_gpu, **SMALL_HBM, **TIER, kv_offloading_size="64MiB")
    try:
        system = random_prompts([70], 320, seed=1)[0]
        messages = random_prompts([5 + 9 * i for i in range(SESSIONS * (TURNS + 1))], 320, seed=2)
        prompts = [system + messages[s] for s in range(SESSIONS)]
        parted = []
        for turn in range(TURNS):
            want = roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got = tier.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            parted += [first_divergence(a, b, 1e-2) for a, b in zip(want, got, strict=True)]
            prompts = [p + w.outputs[0].token_ids + messages[(turn + 1) * SESSIONS + s]
                       for s, (p, w) in enumerate(zip(prompts, want, strict=True))]
        assert sum(p is not None for p in parted) <= 1, f"first divergence per request: {parted}"
        offload = tier.get_metrics()["offload"]
        assert offload["loads_done"] > 0 and offload["loads_failed"] == 0 and offload["saves_done"] > 0
        assert_nothing_held(tier)
    finally:
        roomy.shutdown()
        tier.shutdown()


def test_cache_control_admission_saves_only_hinted_requests(model_dir, reference):
    """--kv-offloading-admission cache_control: the sessions without the hint save nothing to the tier
    (outputs as without it); a request that carries {"type": "ephemeral"} is saved; nothing is held."""
    llm = LLM(model=model_dir, **COMMON, **SMALL_HBM, **TIER, kv_offloading_size="64MiB",
              kv_offloading_admission="cache_control")
    try:
        assert_same(run_sessions(llm), reference)
        offload = llm.get_metrics()["offload"]
        assert offload["saves_planned"] == offload["saves_done"] == 0 and offload["loads_done"] == 0
        hinted = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                extra_args={"cache_control": {"type": "ephemeral"}})
        llm.generate([{"prompt_token_ids": random_prompts([200], 320, seed=9)[0]}], hinted, use_tqdm=False)
        offload = llm.get_metrics()["offload"]
        assert offload["saves_done"] > 0 and offload["pending_saves"] == 0
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="kv_offloading_admission"):
        LLM(model=model_dir, **COMMON, kv_offloading_size="64MiB", kv_offloading_admission="hinted")
