"""After loading, each attention layer's input projections run as one GEMM (KDA: q/k/v, f_a, b, g_a;
MLA: q or q_a, kv_a) and a single shared expert runs inside the routed experts' grouped GEMMs: the same
outputs as the separate layers, whose weights stay views of the fused ones."""

from __future__ import annotations

import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.layers.linear import Linear, fuse_weights
from deltaserve.model.layers.moe import SparseMoE


def test_fused_weights_are_the_layers_side_by_side():
    parallel = ParallelConfig()
    layers = [Linear(12, n, parallel, torch.float32) for n in (5, 3, 7)]
    for layer in layers:
        layer.weight.data.normal_()
    x = torch.randn(4, 12)
    separate = [layer(x) for layer in layers]
    fused = fuse_weights(layers)
    assert torch.equal(torch.cat([layer(x) for layer in layers], dim=1), torch.cat(separate, dim=1))
    assert torch.allclose(x @ fused.T, torch.cat(separate, dim=1), atol=1e-6)
    layers[1].weight.weight_loader(layers[1].weight, torch.ones(3, 12))  # a reload lands in the fused weight
    assert torch.equal(fused[5:8], torch.ones(3, 12))
    with pytest.raises(ValueError, match="one input size"):
        fuse_weights([Linear(12, 2, parallel, torch.float32), Linear(10, 2, parallel, torch.float32)])


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_fusions_match_the_separate_layers(tmp_path_factory, q_lora_rank):
    config = tiny_hub_config(q_lora_rank=q_lora_rank)
    model_dir, _ = checkpoint_dir(tmp_path_factory, f"fused-{q_lora_rank}", config, seed=3)
    prompts = random_prompts([9, 40], config["vocab_size"], 3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = []
    for fused in (True, False):
        llm = LLM(model=model_dir, dtype="float32", device="cpu", block_size=16)
        model = llm.llm_engine.executor.worker.runner.model
        layers = [*model.kda_layers(), *model.mla_layers()]
        moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        assert all(layer.in_proj_weight is not None for layer in layers) and all(m.shared_fused for m in moes)
        if not fused:
            for layer in layers:
                layer.in_proj_weight = None
            for moe in moes:  # the routed ids never pick expert E: the stack's last group stays empty
                moe.shared_fused = False
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t].logprob - step_b[t].logprob) < 1e-5 for t in step_a)


def test_prefill_chunks_expand_their_latents_in_groups():
    """MLA prefill expands consecutive chunks' latents by one GEMM while they hold at most
    EXPANSION_GROUP_TOKENS cached tokens together; a longer chunk goes alone."""
    from deltaserve.model.forward_context import PrefillSequence
    from deltaserve.model.layers import mla

    cap = mla.EXPANSION_GROUP_TOKENS

    def chunk(context, new):
        return PrefillSequence(0, new, context, torch.zeros(1, dtype=torch.long))

    chunks = (chunk(0, 100), chunk(cap - 1000, 900), chunk(0, 700), chunk(2 * cap, 10), chunk(1, 2))
    groups = mla._expansion_groups(chunks)
    assert [[chunks.index(c) for c in g] for g in groups] == [[0, 1], [2], [3], [4]]
