"""Every tensor of a Kimi Linear checkpoint in the hub layout: its name, shape and stored dtype.

The hub layout is the one Moonshot published (and the one `transformers`' `save_pretrained`
writes back): per-expert `w1`/`w2`/`w3` matrices, separate q/k/v short-conv weights, the forget gate
flat under `self_attn`. A dense layer's MLP is `mlp.*` here, as in the published checkpoint;
`transformers` writes it as `block_sparse_moe.*` (it renames every `.mlp.` on save), and readers
accept both.
"""

from __future__ import annotations

from deltaserve.config.model_config import DENSE_MLP, LINEAR_ATTENTION, KimiLinearConfig

MODEL_DTYPE = "model"  # stored in the checkpoint's torch_dtype
FLOAT32 = "float32"  # always stored in float32 (transformers' `_keep_in_fp32_modules_strict`)

TensorShapes = dict[str, tuple[tuple[int, ...], str]]


def _kda(p: str, c: KimiLinearConfig) -> TensorShapes:
    h, dk, d = c.linear_num_heads, c.linear_head_dim, c.hidden_size
    qkv, w = c.kda_qkv_dim, c.short_conv_kernel_size
    out: TensorShapes = {}
    for x in ("q", "k", "v"):
        out[f"{p}.{x}_proj.weight"] = ((qkv, d), MODEL_DTYPE)
    for x in ("q", "k", "v"):
        out[f"{p}.{x}_conv1d.weight"] = ((qkv, 1, w), MODEL_DTYPE)
    out[f"{p}.f_a_proj.weight"] = ((dk, d), MODEL_DTYPE)
    out[f"{p}.f_b_proj.weight"] = ((qkv, dk), MODEL_DTYPE)
    out[f"{p}.A_log"] = ((1, 1, h, 1), MODEL_DTYPE)
    out[f"{p}.dt_bias"] = ((qkv,), FLOAT32)
    out[f"{p}.b_proj.weight"] = ((h, d), MODEL_DTYPE)
    out[f"{p}.g_a_proj.weight"] = ((dk, d), MODEL_DTYPE)
    out[f"{p}.g_b_proj.weight"] = ((qkv, dk), MODEL_DTYPE)
    out[f"{p}.o_norm.weight"] = ((dk,), MODEL_DTYPE)
    out[f"{p}.o_proj.weight"] = ((d, qkv), MODEL_DTYPE)
    return out


def _mla(p: str, c: KimiLinearConfig) -> TensorShapes:
    h, d = c.num_attention_heads, c.hidden_size
    out: TensorShapes = {}
    if c.q_lora_rank is None:
        out[f"{p}.q_proj.weight"] = ((h * c.qk_head_dim, d), MODEL_DTYPE)
    else:
        out[f"{p}.q_a_proj.weight"] = ((c.q_lora_rank, d), MODEL_DTYPE)
        out[f"{p}.q_a_layernorm.weight"] = ((c.q_lora_rank,), MODEL_DTYPE)
        out[f"{p}.q_b_proj.weight"] = ((h * c.qk_head_dim, c.q_lora_rank), MODEL_DTYPE)
    out[f"{p}.kv_a_proj_with_mqa.weight"] = ((c.kv_lora_rank + c.qk_rope_head_dim, d), MODEL_DTYPE)
    out[f"{p}.kv_a_layernorm.weight"] = ((c.kv_lora_rank,), MODEL_DTYPE)
    out[f"{p}.kv_b_proj.weight"] = ((h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), MODEL_DTYPE)
    out[f"{p}.o_proj.weight"] = ((d, h * c.v_head_dim), MODEL_DTYPE)
    return out


def _gated_mlp(p: str, hidden: int, inter: int) -> TensorShapes:
    return {
        f"{p}.gate_proj.weight": ((inter, hidden), MODEL_DTYPE),
        f"{p}.up_proj.weight": ((inter, hidden), MODEL_DTYPE),
        f"{p}.down_proj.weight": ((hidden, inter), MODEL_DTYPE),
    }


def _moe(p: str, c: KimiLinearConfig) -> TensorShapes:
    d, i, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    out: TensorShapes = {
        f"{p}.gate.weight": ((e, d), FLOAT32),
        f"{p}.gate.e_score_correction_bias": ((e,), FLOAT32),
    }
    for j in range(e):
        out[f"{p}.experts.{j}.w1.weight"] = ((i, d), MODEL_DTYPE)  # gate
        out[f"{p}.experts.{j}.w2.weight"] = ((d, i), MODEL_DTYPE)  # down
        out[f"{p}.experts.{j}.w3.weight"] = ((i, d), MODEL_DTYPE)  # up
    if c.num_shared_experts:
        out.update(_gated_mlp(f"{p}.shared_experts", d, i * c.num_shared_experts))
    return out


def layer_tensor_shapes(config: KimiLinearConfig, layer: int) -> TensorShapes:
    """The tensors of decoder layer `layer` (0-based), named `model.layers.{layer}.*`."""
    p = f"model.layers.{layer}"
    d = config.hidden_size
    out: TensorShapes = {f"{p}.input_layernorm.weight": ((d,), MODEL_DTYPE)}
    if config.layer_types[layer] == LINEAR_ATTENTION:
        out.update(_kda(f"{p}.self_attn", config))
    else:
        out.update(_mla(f"{p}.self_attn", config))
    out[f"{p}.post_attention_layernorm.weight"] = ((d,), MODEL_DTYPE)
    if config.mlp_layer_types[layer] == DENSE_MLP:
        out.update(_gated_mlp(f"{p}.mlp", d, config.intermediate_size))
    else:
        out.update(_moe(f"{p}.block_sparse_moe", config))
    return out


def hub_tensor_shapes(config: KimiLinearConfig) -> TensorShapes:
    """name -> (shape, MODEL_DTYPE | FLOAT32) for every tensor of the checkpoint, in a fixed order.

    `lm_head.weight` is absent when `tie_word_embeddings` is set.
    """
    d = config.hidden_size
    out: TensorShapes = {"model.embed_tokens.weight": ((config.vocab_size, d), MODEL_DTYPE)}
    for layer in range(config.num_hidden_layers):
        out.update(layer_tensor_shapes(config, layer))
    out["model.norm.weight"] = ((d,), MODEL_DTYPE)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ((config.vocab_size, d), MODEL_DTYPE)
    return out
