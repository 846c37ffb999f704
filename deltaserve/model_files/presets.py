"""Named model configurations: a tiny one for CPU tests, a ~1B one for quick GPU runs, the real 48B.

Each preset is a hub-style config.json dict, exactly as `KimiLinearConfig.to_hub_dict` writes it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from deltaserve.config.model_config import SPARSE_MLP, KimiLinearConfig
from deltaserve.model_files.hub_layout import hub_tensor_shapes


def _hub_config(
    *, num_hidden_layers: int, full_attn_layers: list[int], linear_num_heads: int, linear_head_dim: int,
    **fields: Any,
) -> dict[str, Any]:
    """A hub config.json; `full_attn_layers` are 1-based (as published), every other layer is KDA."""
    kda_layers = [i for i in range(1, num_hidden_layers + 1) if i not in full_attn_layers]
    d = dict(
        model_type="kimi_linear",
        num_hidden_layers=num_hidden_layers,
        linear_attn_config=dict(
            head_dim=linear_head_dim, num_heads=linear_num_heads, short_conv_kernel_size=4,
            kda_layers=kda_layers, full_attn_layers=full_attn_layers,
        ),
        first_k_dense_replace=1,
        hidden_act="silu",
        tie_word_embeddings=False,
        **fields,
    )
    return KimiLinearConfig.from_dict(d).to_hub_dict()


# Byte tokenizer ids (see tokenizer.py): bytes 0..255, then <|bos|>, <|eos|>, <|pad|>, ...
_BYTE_SPECIALS = dict(bos_token_id=256, eos_token_id=257, pad_token_id=258)

# moonshotai/Kimi-Linear-48B-A3B-Instruct as published
_fields_48b: dict[str, Any] = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
    num_hidden_layers=27, full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
    num_attention_heads=32, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    linear_num_heads=32, linear_head_dim=128,
    num_experts=256, num_experts_per_token=8, num_shared_experts=1,
    num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446,
    rms_norm_eps=1e-5, model_max_length=1048576, torch_dtype="bfloat16",
    bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
)

PRESETS: dict[str, dict[str, Any]] = {
    # [KDA, KDA, MLA, KDA]; layer 0 dense, the rest MoE with two expert groups.
    "tiny": _hub_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, full_attn_layers=[3],
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_num_heads=4, linear_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        num_expert_group=2, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446,
        rms_norm_eps=1e-5, model_max_length=4096, torch_dtype="float32", **_BYTE_SPECIALS,
    ),
    # ~1.0B total / ~0.27B active: the real head dims and top-8 routing, fewer and narrower layers.
    "small": _hub_config(
        vocab_size=32768, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=384,
        num_hidden_layers=12, full_attn_layers=[4, 8, 12],
        num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        linear_num_heads=16, linear_head_dim=128,
        num_experts=64, num_experts_per_token=8, num_shared_experts=1,
        num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446,
        rms_norm_eps=1e-5, model_max_length=1048576, torch_dtype="bfloat16", **_BYTE_SPECIALS,
    ),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct as published.
    "kimi-linear-48b-a3b": _hub_config(**_fields_48b),
    # The 48B's layers, eight of them ([KDA x 3, MLA] twice, layer 0 dense): about 14B parameters (28 GB
    # in bfloat16), the 48B's per-layer costs and its KDA image to KV block ratio on one 80 GB GPU, where
    # the full shape's 96 GB do not fit. For benchmarks; nobody's checkpoint.
    "kimi-linear-48b-a3b-8l": _hub_config(**{**_fields_48b, "num_hidden_layers": 8, "full_attn_layers": [4, 8]}),
}

def preset_config(name: str) -> KimiLinearConfig:
    """The named preset as a config; an unknown name is a ValueError listing the presets."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; choose one of {', '.join(sorted(PRESETS))}")
    return KimiLinearConfig.from_dict(PRESETS[name])


class ParameterCount(NamedTuple):
    total: int
    active: int  # per token: all but the unrouted experts and the embedding table (a row lookup)


def count_parameters(config: KimiLinearConfig) -> ParameterCount:
    """Parameters in the checkpoint, and those one token's forward pass multiplies with."""
    shapes = hub_tensor_shapes(config)
    total = 0
    for shape, _ in shapes.values():
        n = 1
        for s in shape:
            n *= s
        total += n
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    num_moe_layers = sum(1 for t in config.mlp_layer_types if t == SPARSE_MLP)
    unrouted = num_moe_layers * (config.num_experts - config.num_experts_per_token) * per_expert
    embedding = config.vocab_size * config.hidden_size
    active = total - unrouted - (embedding if not config.tie_word_embeddings else 0)
    return ParameterCount(total, active)
