"""transformers' KimiLinearForCausalLM as the oracle: random tiny checkpoints and greedy references."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from deltaserve.config.model_config import KimiLinearConfig


def tiny_hub_config(**overrides) -> dict:
    """A hub-style config.json dict of a tiny model; overrides replace top-level keys."""
    d = dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"],
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1,
        moe_renormalize=True, routed_scaling_factor=2.446, first_k_dense_replace=1,
        linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4,
                                kda_layers=[1, 2, 4], full_attn_layers=[3]),
        rms_norm_eps=1e-5, model_max_length=4096, torch_dtype="float32",
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    d.update(overrides)
    return d


def build_hf_model(hub_config: dict, seed: int):
    """A transformers model with random weights spread wide enough that greedy choices are clear."""
    from transformers import KimiLinearConfig as HFConfig
    from transformers import KimiLinearForCausalLM

    ours = KimiLinearConfig.from_dict(hub_config)
    kwargs = {k: v for k, v in ours.to_hub_dict().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(HFConfig(**kwargs)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue
            if p.dim() == 1:  # norm weights and the router bias: around 1, or around 0 for the bias
                base = 0.0 if "e_score_correction_bias" in name else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def save_hf_checkpoint(model, out_dir: str) -> str:
    model.save_pretrained(out_dir)
    return out_dir


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[float]  # of each greedy token


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], num_tokens: int) -> Reference:
    """Token-by-token greedy decoding with transformers' cache; logprobs in float32."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(num_tokens):
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(input_ids=torch.tensor([[tok]]), cache=out.cache, use_cache=True)
    return Reference(tokens, logprobs)


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def checkpoint_dir(tmp_path_factory, name: str, hub_config: dict, seed: int):
    out = str(tmp_path_factory.mktemp(name))
    model = build_hf_model(hub_config, seed)
    save_hf_checkpoint(model, out)
    assert os.path.isfile(os.path.join(out, "config.json"))
    return out, model
