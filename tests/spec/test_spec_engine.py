"""Speculative decoding through the engine on the tiny random model: greedy outputs identical with
speculation on and off (n-gram drafts, k = 1, 3, 5), with prefix caching, chunked prefill, preemption and
aborts; nothing leaked; the counters add up."""

from __future__ import annotations

import random

import pytest
import torch
from graph_replay import check_replays_against_layout
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out, _ = checkpoint_dir(tmp_path_factory, "spec", tiny_hub_config(), seed=41)
    return out


def make_llm(model_dir, k=None, **options):
    options = {"dtype": "float32", "device": "cpu", "block_size": BS, "max_num_batched_tokens": 96, **options}
    if k is not None:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return LLM(model=model_dir, **options)


def repetitive_prompts(n=4):
    """Prompts that repeat themselves, so n-gram lookup finds drafts the model may accept."""
    pieces = random_prompts([9 + 4 * i for i in range(n)], 320, seed=5)
    return [p * 3 for p in pieces]


def greedy(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_nothing_held(llm):
    engine = llm.llm_engine
    s = engine.scheduler
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == engine.cache_plan.num_blocks
    assert s.state_pool.num_free == engine.cache_plan.num_state_slots
    s.check_invariants()


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = make_llm(model_dir, enable_prefix_caching=False)
    return run(llm, repetitive_prompts(), greedy())


class OracleDrafts:
    """A test drafter that knows the greedy answer: each call drafts a random number of right tokens,
    then wrong ones, so verify windows accept every count from 0 to n drafts."""

    def __init__(self, prompts, answers, vocab_size=320, seed=0):
        self.answers = {tuple(p): a for p, a in zip(prompts, answers, strict=True)}
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def __call__(self, request, n):
        truth = self.answers[tuple(request.prompt_token_ids)][request.num_output_tokens:]
        right = self.rng.randint(0, n)
        drafts = list(truth[:right])
        drafts += [(t + 1) % self.vocab_size for t in truth[right:n]]
        return drafts


def speculating_llm(model_dir, k, prompts, answers, **options):
    llm = make_llm(model_dir, k=k, **options)
    llm.llm_engine.scheduler.spec.proposer = OracleDrafts(prompts, answers)
    return llm


def assert_counters_add_up(llm):
    spec = llm.llm_engine.get_metrics()["spec_decode"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    return spec


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("caching", [False, True])
def test_greedy_identical_with_speculation(model_dir, reference, k, caching):
    """Every accept count from 0 to k drafts, rolled back: the tokens plain decoding gives."""
    prompts = repetitive_prompts()
    llm = speculating_llm(model_dir, k, prompts, reference, enable_prefix_caching=caching)
    assert run(llm, prompts, greedy()) == reference
    assert_counters_add_up(llm)
    assert_nothing_held(llm)


def test_ngram_drafts_on_a_random_model_stay_lossless(model_dir, reference):
    llm = make_llm(model_dir, k=3)
    assert run(llm, repetitive_prompts(), greedy()) == reference
    assert llm.llm_engine.get_metrics()["spec_decode"]["num_drafts"] > 0
    assert_nothing_held(llm)


def test_chunked_prefill_preemption_and_a_stop_token_inside_an_accepted_run(model_dir, reference):
    prompts = repetitive_prompts()
    # a small budget chunks the prompts and cuts windows short; few blocks preempt requests mid-decode
    llm = speculating_llm(model_dir, 5, prompts, reference, max_num_batched_tokens=24, num_kv_blocks=9)
    assert run(llm, prompts, greedy()) == reference
    assert llm.llm_engine.get_metrics()["scheduler"]["num_preemptions"] > 0
    assert_counters_add_up(llm)
    assert_nothing_held(llm)
    # a stop id met inside a window ends the request at that token, the tokens after it dropped
    stop = reference[0][9]
    first = reference[0].index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    assert run(llm, prompts[:1], params) == [reference[0][: first + 1]]
    # max_tokens within a window
    assert run(llm, prompts[:1], greedy(7)) == [reference[0][:7]]
    assert_nothing_held(llm)


def test_prefix_hits_and_aborts(model_dir, reference):
    """A second turn resumes from the end-of-sequence checkpoint that its first turn's verify windows
    left in the boundary slot, then verifies on; an abort mid-run frees its spare slots with the rest."""
    prompts = repetitive_prompts()
    second = [p + a + p[:5] for p, a in zip(prompts, reference, strict=True)]
    second_reference = run(make_llm(model_dir, enable_prefix_caching=False), second, greedy())
    llm = speculating_llm(model_dir, 3, prompts + second, reference + second_reference)
    assert run(llm, prompts, greedy()) == reference
    assert run(llm, second, greedy()) == second_reference
    metrics = llm.llm_engine.get_metrics()
    assert metrics["prefix_cache"]["hit_tokens"] > 0 and metrics["checkpoints"]["filed"].get("end_of_sequence")
    engine = llm.llm_engine
    engine.add_request("gone", {"prompt_token_ids": prompts[1]}, greedy())
    for _ in range(4):
        engine.step()
    engine.abort_request(["gone"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def test_seeded_sampling_is_reproducible_under_speculation(model_dir, reference):
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = speculating_llm(model_dir, 3, prompts, reference)
        runs.append(run(llm, prompts, params))
    assert runs[0] == runs[1]


def test_requests_with_logprobs_decode_without_drafts(model_dir, reference):
    prompts = repetitive_prompts()
    llm = speculating_llm(model_dir, 3, prompts, reference)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(len(o.outputs[0].logprobs) == 24 for o in outs)
    assert llm.llm_engine.get_metrics()["spec_decode"]["num_drafts"] == 0


def test_refused_configurations():
    from deltaserve.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="x", async_scheduling=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="x", speculative_config='{"method": "ngram", "num_speculative_tokens": 0}')


def test_a_stop_string_inside_an_accepted_run_ends_at_its_token():
    """The embedded model and its tokenizer: a stop string completed by a token in the middle of a
    window ends the request there, text and token ids as without speculation."""
    prompt = "def fibonacci(n):\n"
    plain = LLM(dtype="float32")
    ids = plain.generate([prompt], greedy(1), use_tqdm=False)[0].prompt_token_ids
    full = plain.generate([{"prompt_token_ids": ids}], greedy(24), use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = plain.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    llm.llm_engine.scheduler.spec.proposer = OracleDrafts([ids], [list(full.token_ids)], vocab_size=1 << 16)
    got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), "stop")
    assert len(got.token_ids) < 24
    assert_counters_add_up(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verify_windows_with_fla(model_dir):
    """On the GPU, verify windows run fla's spec-decoding kernel (and the draft model its own caches):
    greedy tokens equal plain decoding's on the same device."""
    prompts = repetitive_prompts()
    cuda = {"dtype": "float32", "device": "cuda", "block_size": BS, "max_num_batched_tokens": 96,
            "cache_memory": "64MiB"}
    plain = LLM(model=model_dir, **cuda)
    want = run(plain, prompts, greedy())
    plain.llm_engine.shutdown()
    llm = LLM(model=model_dir, **cuda, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.llm_engine.scheduler.spec.proposer = OracleDrafts(prompts, want)
    assert run(llm, prompts, greedy()) == want
    assert_counters_add_up(llm)
    llm.llm_engine.shutdown()
    draft = LLM(model=model_dir, **cuda, speculative_config={"method": "draft_model", "model": model_dir,
                                                             "num_speculative_tokens": 3})
    assert run(draft, prompts, greedy()) == want
    assert draft.get_metrics()["spec_decode"]["acceptance_rate"] > 0.9
    draft.llm_engine.shutdown()


def lay_out_verify_graphs(llm, k, sizes=(1, 2, 4, 8)):
    """The verify graphs' padded layout, run eagerly (the CPU has no graphs): every step it serves is
    recorded as (decode rows, window lengths)."""
    from deltaserve.worker.verify_graph import VerifyGraphs

    engine = llm.llm_engine
    runner = engine.executor.worker.runner
    plan = engine.cache_plan
    graphs = VerifyGraphs(runner.model, runner.device, BS, engine.config.max_model_len or 2048,
                          plan.num_blocks, plan.num_state_slots, window=k + 1)
    graphs.lay_out_without_capture(sizes)
    served = []
    run_layout = graphs.run

    def recording_run(input_ids, context):
        served.append((context.num_decodes, context.verify_seq_lens))
        return run_layout(input_ids, context)

    graphs.run = recording_run
    runner.verify_graphs = graphs
    return served


def test_verify_graph_layout_is_lossless(model_dir, reference):
    """A verify graph's layout (windows padded to k + 1 tokens, decode rows as one-token windows, padding
    in the scratch block and slot, unused windows up to the graph size) gives plain decoding's tokens,
    with short windows (the token budget), decode rows beside windows (logprobs) and rollbacks."""
    prompts = repetitive_prompts()
    # a budget of 14 tokens cuts windows short when four requests verify together
    llm = speculating_llm(model_dir, 3, prompts, reference, max_num_seqs=8, max_num_batched_tokens=14)
    served = lay_out_verify_graphs(llm, 3, sizes=(2, 8))
    logprobs = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(), logprobs, greedy(), greedy(22)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[0], reference[1], reference[2], reference[3][:22]]
    assert served and any(decodes for decodes, _ in served), served
    assert any(min(lengths) < 4 for _, lengths in served), served  # a window cut short
    assert any(decodes + len(lengths) not in (2, 8) for decodes, lengths in served), served  # padding windows
    assert_counters_add_up(llm)
    assert_nothing_held(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verify_graph_replay_equals_its_eager_layout(model_dir):
    """bfloat16 on the GPU captures verify graphs; every step one serves gives, bit for bit, the logits of
    the same padded layout run eagerly (run first on a copy of the KDA state, which the replay then steps).
    That the padded layout gives plain decoding's tokens is test_verify_graph_layout_is_lossless's (CPU,
    float32); against the unpadded eager step a bf16 graph differs by rounding (GEMMs of another row
    count, another MLA split count), which a near-tie in the tiny random model's expert routing turns
    into a visibly different row."""
    from deltaserve.worker.verify_graph import VerifyGraphs

    prompts = repetitive_prompts()
    cuda = {"dtype": "bfloat16", "device": "cuda", "block_size": BS, "max_num_batched_tokens": 96,
            "cache_memory": "64MiB", "max_num_seqs": 8}
    llm = LLM(model=model_dir, **cuda, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.llm_engine.scheduler.spec.proposer = OracleDrafts(prompts, run(make_llm(model_dir), prompts, greedy()))
    runner = llm.llm_engine.executor.worker.runner
    graphs = runner.verify_graphs
    assert graphs is not None and graphs.graphs, "verify graphs were not captured"
    layout = VerifyGraphs(graphs.model, graphs.device, graphs.block_size, graphs.max_model_len, graphs.pad_block,
                          graphs.pad_state_slot, window=graphs.window)
    layout.lay_out_without_capture(sorted(graphs.graphs))
    same = check_replays_against_layout(runner, graphs, layout)
    run(llm, prompts, greedy())
    assert_counters_add_up(llm)
    llm.llm_engine.shutdown()
    assert same and all(same), f"{same.count(False)} of {len(same)} replays differ from their eager layout"
