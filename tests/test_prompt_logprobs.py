"""Prompt logprobs (SamplingParams.prompt_logprobs) equal log_softmax of transformers' logits on the
prompt (float32, CPU), whatever the chunking, batching, prefix cache, async scheduling or preemption."""

from __future__ import annotations

import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams

VOCAB = 320
TOL = 1e-4
PROMPT_LENGTHS = [1, 2, 17, 40, 70, 130]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint, the prompts and transformers' [len, vocab] float32 logprobs of each."""
    model_dir, hf_model = checkpoint_dir(tmp_path_factory, "prompt-logprobs", tiny_hub_config(), seed=31)
    prompts = random_prompts(PROMPT_LENGTHS, VOCAB, seed=4)
    with torch.inference_mode():
        references = [torch.log_softmax(hf_model(input_ids=torch.tensor([p])).logits[0].float(), dim=-1)
                      for p in prompts]
    return model_dir, prompts, references


def assert_matches(out, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    """out.prompt_logprobs against the reference: per position i > 0 the prompt token's logprob given
    tokens < i and its rank, and the top-k with ranks 1..k."""
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = reference[i - 1], prompt[i], got[i]
        assert abs(entry[token].logprob - row[token].item()) < TOL, f"position {i}"
        # the rank counts tokens at least as likely; a reference within TOL may fall either side
        surely_above = int((row > row[token] + TOL).sum())
        maybe_above = int((row >= row[token] - TOL).sum())
        assert surely_above + 1 <= entry[token].rank <= maybe_above, f"position {i}"
        top = {t: lp for t, lp in entry.items() if t != token or lp.rank <= k}
        assert sorted(lp.rank for lp in top.values()) == list(range(1, k + 1)), f"position {i}"
        assert len(entry) in (k, k + 1)
        ranked = row.sort(descending=True).values
        for t, lp in top.items():
            assert abs(lp.logprob - row[t].item()) < TOL and abs(lp.logprob - ranked[lp.rank - 1].item()) < TOL


def batch(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_transformers(case, async_scheduling):
    """Chunked prefill (13 tokens a step, so prompts span many chunks and share steps), a batch mixing
    k = 0, 3, 5 and requests that did not ask, prefix caching on."""
    model_dir, prompts, references = case
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=13,
              async_scheduling=async_scheduling)
    ks = [3, 0, 5, None, 3, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k) for k in ks]
    outputs = llm.generate(batch(prompts), params, use_tqdm=False)
    for out, prompt, reference, k in zip(outputs, prompts, references, ks, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches(out, prompt, reference, k)
        assert len(out.outputs[0].token_ids) == 1
    llm.llm_engine.scheduler.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_repeated_prompt_still_gets_every_prompt_logprob(case, async_scheduling):
    """With prefix caching on, a prompt seen before is computed again for its logits (no hit), and
    what it computes still serves a request that did not ask."""
    model_dir, prompts, references = case
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=48,
              async_scheduling=async_scheduling)
    prompt, reference = prompts[-1], references[-1]  # 130 tokens: a prompt-end checkpoint at 128
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate(batch([prompt]), scored, use_tqdm=False)[0]
    served = llm.generate(batch([prompt]), plain, use_tqdm=False)[0]
    again = llm.generate(batch([prompt, prompt]), scored, use_tqdm=False)
    assert served.num_cached_tokens > 0 and served.prompt_logprobs is None
    for out in [first, *again]:
        assert out.num_cached_tokens == 0
        assert_matches(out, prompt, reference, 2)
        assert out.outputs[0].token_ids == served.outputs[0].token_ids
    llm.llm_engine.scheduler.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_survive_preemption(case, async_scheduling):
    """A cache too small for the batch preempts requests, some in the middle of their prompts (and,
    with async scheduling, with a step of theirs in flight): each prompt logprob still arrives once,
    in order, with the right value."""
    model_dir, prompts, references = case
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=14, max_num_batched_tokens=32,
              block_size=16, async_scheduling=async_scheduling)
    chosen = [3, 4, 5, 2]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(batch([prompts[i] for i in chosen]), params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for out, i in zip(outputs, chosen, strict=True):
        assert_matches(out, prompts[i], references[i], 1)
        assert len(out.outputs[0].token_ids) == 40
    llm.llm_engine.scheduler.check_invariants()


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_out_of_range_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match=r"^prompt_logprobs="):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_above_max_logprobs_are_refused(case):
    model_dir, prompts, _ = case
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_logprobs=2)
    with pytest.raises(ValueError, match=r"prompt_logprobs=3 exceeds max_logprobs=2"):
        llm.generate(batch(prompts[:1]), SamplingParams(prompt_logprobs=3), use_tqdm=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_prompt_logprobs_match_cpu(tmp_path_factory, async_scheduling):
    """The GPU runner's prompt-logprob path (float32, chunked) against the CPU engine's. No
    transformers reference here: on a CUDA machine fla imports and transformers would run its
    Triton kernels on CPU tensors. fla's TF32 dots allow ~1e-2 (test_parity's GPU tolerance)."""
    model_dir, _ = checkpoint_dir(tmp_path_factory, "gpu-prompt-logprobs", tiny_hub_config(), seed=31)
    prompts = random_prompts(PROMPT_LENGTHS, VOCAB, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=13)
    gpu = LLM(model=model_dir, dtype="float32", device="cuda", max_num_batched_tokens=13, cache_memory="256MiB",
              async_scheduling=async_scheduling)
    for a, b, prompt in zip(cpu.generate(batch(prompts), params, use_tqdm=False),
                            gpu.generate(batch(prompts), params, use_tqdm=False), prompts, strict=True):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            token = prompt[i]
            assert abs(a.prompt_logprobs[i][token].logprob - b.prompt_logprobs[i][token].logprob) < 2e-2, i
    gpu.llm_engine.scheduler.check_invariants()
