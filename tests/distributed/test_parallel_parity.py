"""Tensor, pipeline and expert parallelism over gloo on CPU match the single-process model.

One module-scoped fixture starts six worlds at once (TP=2, PP=2, TP=2 x PP=2, TP=2 through the
engine's ModelRunner, and TP=2 and TP=2 x PP=2 with enable_expert_parallel: 16 rank processes), each
loading its shards of the same tiny checkpoint (4 layers: KDA, KDA, MLA, KDA; a dense first MLP, MoE
after, 8 routed experts: 4 whole experts per TP rank under expert parallelism). The parent schedules with a
deterministic Scheduler, sends every SchedulerOutput to every rank, runs the same step on a
single-process reference and compares the last stages' logits (the ModelRunner world: its greedy
tokens): a prefill chunked over two steps (KDA state and MLA cache carry over), then decode steps
mixed in.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import time
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.request import Request
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.sampling_params import SamplingParams

from .stage_driver import PLAN, make_worker, rank_main, routed_experts, run_stage

# name -> (tp, pp)
WORLDS = {"tp2": (2, 1), "pp2": (1, 2), "tp2_pp2": (2, 2), "tp2_runner": (2, 1), "tp2_ep": (2, 1),
          "tp2_pp2_ep": (2, 2)}
EXPERT_PARALLEL_WORLDS = ("tp2_ep", "tp2_pp2_ep")
TIMEOUT_S = 120  # per message from a rank (the machine may be busy): a hang fails instead of blocking
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    out, _ = checkpoint_dir(tmp_path_factory, "parallel", tiny_hub_config(), seed=31)
    return out


def _stop(procs: list, inboxes: list) -> None:
    for box in inboxes:
        box.put(None)
    for p in procs:
        p.join(timeout=15)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _get(outbox, name: str, procs: list) -> dict[int, object]:
    """One message from each of the world's rank processes; a rank's exception fails here with its
    traceback, a rank that died or went silent for TIMEOUT_S fails here too."""
    got: dict[int, object] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < len(procs):
        try:
            rank, msg = outbox.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
            if dead or time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(got))
                pytest.fail(f"{name}: ranks {missing} sent nothing ({'dead: ' + str(dead) if dead else 'timeout'})")
            continue
        if isinstance(msg, str) and msg.startswith("error"):
            pytest.fail(f"{name} rank {rank} failed:\n{msg}")
        got[rank] = msg
    return got


class ParityRun(NamedTuple):
    # per world name, one entry per step that sampled: (request ids, reference logits, {last-stage rank: logits})
    steps: dict[str, list]
    # per world name, {rank: {layer id: (w13, w2)}}: each rank's routed experts after loading
    experts: dict[str, dict[int, dict]]
    reference_experts: dict[int, tuple]  # the single-process model's, {layer id: (w13, w2)}


@pytest.fixture(scope="module")
def parity_run(model_dir, tmp_path_factory) -> ParityRun:
    """Drive every world and the reference through the same steps."""
    ctx = mp.get_context("spawn")
    root = tmp_path_factory.mktemp("rendezvous")
    procs, inboxes, worlds = [], [], {}  # all rank processes, their inboxes, name -> world
    try:
        for name, (tp, pp) in WORLDS.items():
            outbox, boxes = ctx.Queue(), [ctx.Queue() for _ in range(tp * pp)]
            init_method = f"file://{root / name}"
            world_procs = []
            for rank, box in enumerate(boxes):
                args = (rank, tp, pp, init_method, model_dir, box, outbox, name.endswith("_runner"),
                        name in EXPERT_PARALLEL_WORLDS)
                world_procs.append(ctx.Process(target=rank_main, args=args, daemon=True))
                world_procs[-1].start()
            procs += world_procs
            inboxes += boxes
            last_stage = set(range((pp - 1) * tp, pp * tp))
            worlds[name] = (outbox, world_procs, last_stage)
        reference = make_worker(model_dir, ParallelConfig())  # while the ranks start
        experts = {}
        for name, (outbox, world_procs, _) in worlds.items():
            experts[name] = {rank: ready[1] for rank, ready in _get(outbox, name, world_procs).items()}

        kv_spec, _ = reference.cache_specs()
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=256),
                              KVCacheManager(kv_spec, PLAN.num_blocks), StateSlotPool(PLAN.num_state_slots))
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(random_prompts([20, 13, 7], 320, seed=3)):
            scheduler.add_request(Request(f"r{i}", prompt, MAX_TOKENS, ignore_eos=True, sampling_params=greedy))
        results: dict[str, list] = {name: [] for name in WORLDS}
        while scheduler.has_unfinished_requests():
            step = scheduler.schedule()
            for box in inboxes:
                box.put(step)
            ref = run_stage(reference, step)
            for name, (outbox, world_procs, last_stage) in worlds.items():
                got = _get(outbox, name, world_procs)
                if ref is not None:
                    results[name].append((ref[0], ref[1].numpy(), {r: got[r] for r in last_stage}))
            sampled = {} if ref is None else {rid: int(row.argmax()) for rid, row in zip(*ref, strict=True)}
            scheduler.update_from_output(step, sampled)
        return ParityRun(results, experts, routed_experts(reference))
    finally:
        _stop(procs, inboxes)


@pytest.mark.parametrize("world", ["tp2", "pp2", "tp2_pp2", *EXPERT_PARALLEL_WORLDS])
def test_logits_match_single_process(parity_run, world):
    steps = parity_run.steps[world]
    # the first step prefills r0 and part of r1; the second finishes r1, prefills r2 and decodes r0
    assert len(steps) >= MAX_TOKENS + 1
    assert steps[0][0] == ["r0"] and sorted(steps[1][0]) == ["r0", "r1", "r2"]
    for i, (request_ids, ref_logits, by_rank) in enumerate(steps):
        for rank, (got_ids, logits) in by_rank.items():
            assert got_ids == request_ids, (world, i, rank)
            diff = float(np.abs(logits - ref_logits).max())
            assert diff < 1e-4, f"{world} step {i} rank {rank}: max |logits - reference| = {diff:.2e}"
            assert logits.argmax(-1).tolist() == ref_logits.argmax(-1).tolist(), (world, i, rank)


def test_model_runner_samples_the_same_tokens_at_tp2(parity_run):
    steps = parity_run.steps["tp2_runner"]
    assert len(steps) >= MAX_TOKENS + 1
    for i, (request_ids, ref_logits, by_rank) in enumerate(steps):
        for rank, (got_ids, tokens) in by_rank.items():
            assert (got_ids, tokens) == (request_ids, ref_logits.argmax(-1).tolist()), (i, rank)


@pytest.mark.parametrize("world", EXPERT_PARALLEL_WORLDS)
def test_expert_parallel_ranks_hold_only_their_experts(parity_run, world):
    """Each TP rank holds num_experts / tp whole experts, [tp_rank * 4, tp_rank * 4 + 4), loaded from
    the checkpoint unsplit; every MoE layer of its stage, on every stage."""
    tp, pp = WORLDS[world]
    by_rank, reference = parity_run.experts[world], parity_run.reference_experts
    assert sorted(by_rank) == list(range(tp * pp))
    seen_layers = set()
    for rank, layers in by_rank.items():
        tp_rank = rank % tp
        assert layers, f"{world} rank {rank}: no MoE layer on its stage"
        for layer_id, (w13, w2) in layers.items():
            ref_w13, ref_w2 = reference[layer_id]
            num_experts, two_inter, hidden = ref_w13.shape
            per_rank = num_experts // tp
            assert w13.shape == (per_rank, two_inter, hidden) and w2.shape == (per_rank, hidden, two_inter // 2)
            start = tp_rank * per_rank
            assert np.array_equal(w13, ref_w13[start : start + per_rank]), (world, rank, layer_id)
            assert np.array_equal(w2, ref_w2[start : start + per_rank]), (world, rank, layer_id)
            seen_layers.add(layer_id)
    assert seen_layers == set(reference)
    # without expert parallelism each TP rank holds a slice of every expert instead, and of the shared
    # expert, which rides at the end of the stack (SparseMoE.fuse_shared_expert)
    w13, w2 = next(iter(parity_run.experts["tp2"][0].values()))
    assert w13.shape == (9, 32, 64) and w2.shape == (9, 64, 16)


def test_expert_parallel_refuses_experts_that_do_not_divide(model_dir):
    config = dataclasses.replace(KimiLinearConfig.from_pretrained(model_dir), num_experts=6)
    parallel = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by tensor_parallel_size=4.*"
                                         r"enable_expert_parallel"):
        KimiLinearForCausalLM(config, parallel, torch.float32)
    # without expert parallelism the same split is fine (each expert is split along its intermediate size)
    KimiLinearForCausalLM(config, ParallelConfig(tensor_parallel_size=4), torch.float32)
    # at tensor_parallel_size=1 the option changes nothing, as in vLLM
    alone = ParallelConfig(enable_expert_parallel=True)
    assert not alone.uses_expert_parallel and alone.local_expert_range(7) == (0, 7)
    assert alone.describe_expert_placement(7) == "ep=off (tensor_parallel_size=1)"
    placement = ParallelConfig(tensor_parallel_size=2, tensor_parallel_rank=1, enable_expert_parallel=True)
    assert placement.local_expert_range(8) == (4, 8)
    assert placement.describe_expert_placement(8) == "ep=2 (8 experts, 4 per TP rank: [0, 4), [4, 8))"


def test_tp_that_does_not_divide_heads_is_refused(model_dir):
    config = KimiLinearConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"linear_attn_config.num_heads=4 is not divisible by tensor_parallel_size=3"):
        KimiLinearForCausalLM(config, ParallelConfig(tensor_parallel_size=3), torch.float32)


def test_multi_rank_model_refuses_to_run_without_init_distributed(model_dir):
    config = KimiLinearConfig.from_pretrained(model_dir)
    model = KimiLinearForCausalLM(config, ParallelConfig(tensor_parallel_size=2), torch.float32)
    with pytest.raises(RuntimeError, match="init_distributed"):
        model(torch.tensor([5, 6]))


@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_engine_runs_multi_rank_on_the_multiprocess_executor(option):
    config = EngineConfig(**{option: 2})
    assert config.parallel.world_size == 2 and config.executor_backend == "mp"
    assert EngineConfig().executor_backend == "uniproc"
