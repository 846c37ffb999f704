"""Greedy tokens and logprobs of deltaserve equal transformers' KimiLinearForCausalLM (float32, CPU).

The cases: random configs (hf_reference), and the installed trained tiny target ("trained", prompts
cut from its held-out windows; skipped without weights, see trained_model.py), whose peaked logits
make greedy tokens a sharp check where random weights' near-flat logits tie.
"""

from __future__ import annotations

import pytest
from graph_replay import check_replays_against_layout
from hf_reference import checkpoint_dir, greedy_reference, random_prompts, tiny_hub_config
from trained_model import heldout_prompts, load_hf_trained, reference_or_skip

from deltaserve import LLM, SamplingParams

PROMPT_LENGTHS = [1, 7, 33, 64, 65, 130, 211, 300]
NUM_TOKENS = 32

CONFIGS = {
    # KDA + MLA + MoE + dense layer 0, plain q_proj, one expert group
    "plain": (tiny_hub_config(), 11),
    # q_lora_rank set, grouped top-k over 4 groups keeping 2, MLA first and last
    "qlora-groups": (
        tiny_hub_config(
            q_lora_rank=24, num_expert_group=4, topk_group=2, num_experts=16, num_experts_per_token=3,
            num_hidden_layers=5, first_k_dense_replace=2, moe_renormalize=False,
            linear_attn_config=dict(head_dim=8, num_heads=8, short_conv_kernel_size=3,
                                    kda_layers=[2, 3, 4], full_attn_layers=[1, 5]),
        ),
        12,
    ),
    # two shared experts, wider conv, several MLA layers
    "shared2": (
        tiny_hub_config(
            num_shared_experts=2, num_attention_heads=2, kv_lora_rank=16, qk_rope_head_dim=4,
            linear_attn_config=dict(head_dim=16, num_heads=2, short_conv_kernel_size=4,
                                    kda_layers=[1, 3], full_attn_layers=[2, 4]),
        ),
        13,
    ),
}


TRAINED = "trained"
CASES = [*sorted(CONFIGS), TRAINED]


@pytest.fixture(scope="module", params=CASES)
def parity_case(request, tmp_path_factory):
    if request.param == TRAINED:
        model_dir, reference = reference_or_skip()
        hf_model = load_hf_trained(model_dir)
        prompts = heldout_prompts(reference, PROMPT_LENGTHS)
        return model_dir, prompts, [greedy_reference(hf_model, p, NUM_TOKENS) for p in prompts]
    hub_config, seed = CONFIGS[request.param]
    model_dir, hf_model = checkpoint_dir(tmp_path_factory, request.param, hub_config, seed)
    prompts = random_prompts(PROMPT_LENGTHS, hub_config["vocab_size"], seed)
    references = [greedy_reference(hf_model, p, NUM_TOKENS) for p in prompts]
    return model_dir, prompts, references


def greedy(num_tokens: int = NUM_TOKENS, logprobs: int | None = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=logprobs)


def test_greedy_tokens_and_logprobs_match_transformers(parity_case):
    model_dir, prompts, references = parity_case
    llm = LLM(model=model_dir, dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=4096)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, references, strict=True):
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert completion.token_ids == ref.token_ids, f"prompt of {len(prompt)} tokens diverged"
        assert completion.finish_reason == "length"
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs, strict=True)) < 1e-4
        # the sampled token is the top-ranked one under greedy decoding
        assert all(step[t].rank == 1 for step, t in zip(completion.logprobs, completion.token_ids, strict=True))


@pytest.mark.parametrize("budget", [8, 13, 64, 4096])
def test_chunked_prefill_gives_identical_outputs(parity_case, budget):
    model_dir, prompts, references = parity_case
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:5]], greedy(16, None), use_tqdm=False)
    for out, ref in zip(outputs, references[:5], strict=True):
        assert out.outputs[0].token_ids == ref.token_ids[:16]


@pytest.fixture(scope="module", params=CASES)
def gpu_case(request, tmp_path_factory):
    """A parity checkpoint without transformers' references: on a CUDA machine fla imports, and
    transformers would then run its Triton kernels on CPU tensors."""
    if request.param == TRAINED:
        model_dir, reference = reference_or_skip()
        return model_dir, heldout_prompts(reference, PROMPT_LENGTHS)
    hub_config, seed = CONFIGS[request.param]
    model_dir, _ = checkpoint_dir(tmp_path_factory, "gpu-" + request.param, hub_config, seed)
    return model_dir, random_prompts(PROMPT_LENGTHS, hub_config["vocab_size"], seed)


# fla's kernels use TF32 dots: up to 7e-3 seen on the H200 with random weights (parity_probe_2026-12-03.json), up
# to 0.033 with the trained target's peaked logits on an H100 (2026-12-05; forcing IEEE float32 in Triton made
# fla's autotuned kernels too slow to finish the test file in 185 s)
GPU_LOGPROB_TOL = 5e-2
BF16_LOGPROB_TOL = 0.15  # bf16 against bf16: a logit of ~10 carries ~0.04 of rounding, over many layers


def first_divergence(cpu, gpu, tol: float) -> int | None:
    """The first step where greedy tokens differ, None if none; fails unless that step is a near-tie.

    Before it, each token's logprob agrees within tol. At it, each side's token is in the other's top
    logprobs and the CPU ranks them within tol of each other: a rounding-level tie, not a fault.
    """
    a, b = cpu.outputs[0], gpu.outputs[0]
    for step, (ta, tb, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True)):
        if ta != tb:
            assert tb in la and ta in lb, f"step {step}: tokens {ta} / {tb} are not in each other's top logprobs"
            assert la[ta].logprob - la[tb].logprob < tol, f"step {step}: not a near-tie on the CPU"
            return step
        assert abs(la[ta].logprob - lb[tb].logprob) < tol, f"step {step}: logprobs {la[ta]} vs {lb[tb]}"
    return None


def agreeing_tokens(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy completions share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_float32_matches_cpu(gpu_case, record_property):
    """The GPU path in float32 (fla KDA, Triton MLA decode, norms and conv; the MoE loop, so no CUDA
    graphs) against the CPU references: greedy tokens equal, or parting only at a near-tie.

    fla's Triton kernels compute float32 dots in TF32, so logprobs differ by up to ~1e-2, and a
    near-tie (one was seen with the CPU's top two 4e-5 apart) can go either way. CUDA graphs need the
    bf16 grouped MoE: test_gpu_bf16_graphs_match_eager."""
    model_dir, prompts = gpu_case
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = greedy(logprobs=5)
    cpu = LLM(model=model_dir, dtype="float32", device="cpu").generate(batch, params, use_tqdm=False)
    gpu_llm = LLM(model=model_dir, dtype="float32", device="cuda", max_num_seqs=16, cache_memory="256MiB")
    assert gpu_llm.llm_engine.executor.worker.runner.decode_graphs is None
    gpu = gpu_llm.generate(batch, params, use_tqdm=False)
    parted = [first_divergence(a, b, GPU_LOGPROB_TOL) for a, b in zip(cpu, gpu, strict=True)]
    agree = [agreeing_tokens(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(cpu, gpu, strict=True)]
    record_property("tokens_agreeing_per_prompt", agree)
    print(f"GPU float32 vs CPU: tokens agreeing per prompt (of {NUM_TOKENS}): {agree}")
    assert sum(p is None for p in parted) >= len(parted) - 1, f"first divergence per prompt: {parted}"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_graphs_match_eager(gpu_case, request, record_property):
    """bfloat16 on the GPU: decode replayed from CUDA graphs against the eager path: greedy tokens
    equal, or parting only at a bf16 near-tie (the graphs' padded batches round differently).

    Checked on the trained target; reported only for the random configs, whose logits are nearly flat
    so bf16 rounding flips their argmaxes within a few tokens (10 of 32 agreed on an H100). On the
    trained target, an H100 (2026-12-06) agreed on 6 of 8 prompts and parted at tokens 6 and 30 on the
    others, each time at a near-tie."""
    model_dir, prompts = gpu_case
    batch = [{"prompt_token_ids": p} for p in prompts]
    runs = []
    for eager in (True, False):
        llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", enforce_eager=eager, max_num_seqs=16,
                  cache_memory="256MiB")  # a fixed budget: the engines before it still hold GPU memory
        assert (llm.llm_engine.executor.worker.runner.decode_graphs is None) == eager
        runs.append(llm.generate(batch, greedy(logprobs=5), use_tqdm=False))
    agree = [agreeing_tokens(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(*runs, strict=True)]
    record_property("tokens_agreeing_per_prompt", agree)
    print(f"bf16 graphs vs eager ({request.node.callspec.id}): tokens agreeing per prompt (of {NUM_TOKENS}): {agree}")
    if request.node.callspec.id != TRAINED:
        return
    parted = [first_divergence(a, b, BF16_LOGPROB_TOL) for a, b in zip(*runs, strict=True)]
    assert sum(p is None for p in parted) >= len(parted) // 2, f"first divergence per prompt: {parted}"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_graph_replay_equals_its_eager_layout(gpu_case):
    """What CUDA graphs guarantee: a replay gives, bit for bit, the logits of the same padded batch run
    eagerly (the graph's size, padding rows and fixed MLA split count), checked on every decode step it
    serves (the eager layout runs first on a copy of the KDA state, which the replay then steps).
    Against plain eager decoding a graph differs only by that padding: a batch of B runs as the
    captured size, so GEMMs of another row count and another MLA split count round bf16 differently
    (test_gpu_bf16_graphs_match_eager)."""
    from deltaserve.worker.cuda_graph import DecodeGraphs

    model_dir, prompts = gpu_case
    llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", max_num_seqs=16, cache_memory="256MiB")
    runner = llm.llm_engine.executor.worker.runner
    graphs = runner.decode_graphs
    if graphs is None:
        pytest.skip("no decode graphs on this GPU (the sync-free grouped MoE needs bf16 on sm90+)")
    layout = DecodeGraphs(graphs.model, graphs.device, graphs.block_size, graphs.max_model_len, graphs.pad_block,
                          graphs.pad_state_slot)
    layout.lay_out_without_capture(sorted(graphs.graphs))
    same = check_replays_against_layout(runner, graphs, layout)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    llm.llm_engine.shutdown()
    assert same and all(same), f"{same.count(False)} of {len(same)} replays differ from their eager layout"
