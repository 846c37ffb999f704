"""The multi-process executor's GPU path on one GPU: TP=2, PP=2 and TP=2 x DCP=2 ranks sharing it (gloo, tensors
staged through host memory; correct, not fast) against the single-process GPU engine.

Both run fla's KDA and the Triton MLA kernels in float32 (TF32 dots), and TP sums its heads' partial
results in another order, so greedy tokens must agree up to a near-tie (test_parity's rule) and
logprobs within its GPU tolerance. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_LOGPROB_TOL = 5e-2  # as tests/test_parity.py: fla's TF32 dots
OPTIONS = dict(dtype="float32", device="cuda", cache_memory="256MiB", max_num_batched_tokens=64)


def _first_divergence(a, b) -> int | None:
    a, b = a.outputs[0], b.outputs[0]
    for step, (ta, tb, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True)):
        if ta != tb:
            assert tb in la and la[ta].logprob - la[tb].logprob < GPU_LOGPROB_TOL, f"step {step}: not a near-tie"
            return step
        assert abs(la[ta].logprob - lb[tb].logprob) < GPU_LOGPROB_TOL, f"step {step}"
    return None


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                     dict(tensor_parallel_size=2, decode_context_parallel_size=2)],
                         ids=["tp2", "pp2", "tp2_dcp2"])
def test_ranks_sharing_one_gpu_match_the_single_process_engine(tmp_path_factory, options):
    model_dir, _ = checkpoint_dir(tmp_path_factory, "mp-gpu", tiny_hub_config(), seed=31)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 40, 70, 131], 320, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    want = LLM(model=model_dir, **OPTIONS).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model_dir, **OPTIONS, **options)
    try:
        assert all(r.device.startswith("cuda") for r in llm.llm_engine.executor.ready)
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    parted = [_first_divergence(a, b) for a, b in zip(want, got, strict=True)]
    print(f"{options}: first divergence per prompt: {parted}")
    assert sum(p is None for p in parted) >= len(parted) - 1, parted
