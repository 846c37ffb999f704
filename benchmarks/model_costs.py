"""What the Kimi Linear shape costs: model FLOPs per prefill and bytes read per decode step.

Pure functions of the config, the MFU and MBU numerators of benchmarks/h200_bench.py; unit-tested on
CPU against hand counts in tests/bench/test_h200_bench_helpers.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from deltaserve.config.model_config import DENSE_MLP, LINEAR_ATTENTION, KimiLinearConfig
from deltaserve.model_files.hub_layout import FLOAT32, hub_tensor_shapes

KDA_CHUNK_SIZE = 64  # fla's chunk_kda chunk length


def linear_flops_per_token(config: KimiLinearConfig) -> dict[str, int]:
    """FLOPs (2 per multiply-add) of one token through every matmul but lm_head, by part.

    kda (per KDA layer): q/k/v 3*d*qkv, forget gate d*dk + dk*qkv, beta d*h, output gate d*dk + dk*qkv,
      o_proj qkv*d, depthwise short conv 3*qkv*W.  (d hidden, qkv = h*dk, W conv kernel)
    mla (per MLA layer): q d*H*(nope+rope) (or d*r_q + r_q*H*(nope+rope) with q_lora_rank r_q),
      kv_a d*(R+P), kv_b R*H*(nope+v) (the expanded prefill form), o_proj H*v*d.
    dense_mlp: 3*d*intermediate_size.  router: d*E.  routed_experts: top_k*3*d*I.
    shared_experts: num_shared*3*d*I  (I = moe_intermediate_size).
    """
    c, d = config, config.hidden_size
    macs = dict(kda=0, mla=0, dense_mlp=0, router=0, routed_experts=0, shared_experts=0)
    for i, kind in enumerate(c.layer_types):
        if kind == LINEAR_ATTENTION:
            qkv, dk = c.kda_qkv_dim, c.linear_head_dim
            macs["kda"] += (3 * d * qkv + 2 * (d * dk + dk * qkv) + d * c.linear_num_heads + qkv * d
                            + 3 * qkv * c.short_conv_kernel_size)
        else:
            heads = c.num_attention_heads
            q = d * heads * c.qk_head_dim if c.q_lora_rank is None else (
                d * c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim)
            macs["mla"] += (q + d * c.latent_dim + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
                            + heads * c.v_head_dim * d)
        if c.mlp_layer_types[i] == DENSE_MLP:
            macs["dense_mlp"] += 3 * d * c.intermediate_size
        else:
            macs["router"] += d * c.num_experts
            macs["routed_experts"] += c.num_experts_per_token * 3 * d * c.moe_intermediate_size
            macs["shared_experts"] += c.num_shared_experts * 3 * d * c.moe_intermediate_size
    return {k: 2 * v for k, v in macs.items()}


def lm_head_flops(config: KimiLinearConfig) -> int:
    """2*d*V: one row of logits (prefill computes it only for the token it samples)."""
    return 2 * config.hidden_size * config.vocab_size


def mla_attention_flops(config: KimiLinearConfig, num_new_tokens: int, num_context_tokens: int = 0) -> int:
    """Causal attention FLOPs of all MLA layers for num_new_tokens after num_context_tokens cached.

    A query over n keys costs 2*n*H*(qk_dim + v_dim) (QK^T and PV). New token i sees
    num_context + i + 1 keys, so a prompt of L from scratch costs H*(qk+v)*L*(L+1) per layer, i.e.
    about L*H*(qk+v) per token (FlashAttention's causal count). Writing it as 2*2*(ctx/2)*H*(qk+v)
    per token counts both matmuls twice (the sum qk+v already covers QK^T and PV).
    """
    n, ctx = num_new_tokens, num_context_tokens
    keys = n * ctx + n * (n + 1) // 2
    return 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * keys * len(config.mla_layer_ids)


def kda_chunk_flops(config: KimiLinearConfig, num_tokens: int, chunk_size: int = KDA_CHUNK_SIZE) -> float:
    """Approximate FLOPs of chunked KDA over num_tokens in all KDA layers (matmuls only).

    Per chunk of C tokens and head (K = V = head dim): A_kk and A_qk, lower-triangular, C^2*K MACs
    together; the triangular inverse C^3/6; w and u through it C^2*(K+V)/2; v_new = u - w S, the
    inter-chunk output q S and the state update k^T v_new 3*C*K*V; the intra output A_qk v_new C^2*V/2.
    Per token: C*(1.5K + V) + C^2/6 + 3*K*V MACs. Gates, norms and the conv are elementwise and not
    counted. At C=64, K=V=128 this is about 0.14 MFLOP per token per head.
    """
    c, k = chunk_size, config.linear_head_dim
    macs = c * 2.5 * k + c * c / 6 + 3 * k * k  # V = K
    return 2 * macs * config.linear_num_heads * len(config.kda_layer_ids) * num_tokens


def prefill_flops(config: KimiLinearConfig, prompt_lens: Sequence[int]) -> dict[str, float]:
    """Model FLOPs of prefilling prompts from scratch and sampling one token each.

    total = sum(L) * sum(linear_flops_per_token) + len(prompts) * lm_head_flops
            + sum(mla_attention_flops(L)) + sum(kda_chunk_flops(L)).
    """
    tokens = sum(prompt_lens)
    out: dict[str, float] = {f"linear_{k}": v * tokens for k, v in linear_flops_per_token(config).items()}
    out["lm_head"] = lm_head_flops(config) * len(prompt_lens)
    out["mla_attention"] = sum(mla_attention_flops(config, n) for n in prompt_lens)
    out["kda_chunk"] = sum(kda_chunk_flops(config, n) for n in prompt_lens)
    out["total"] = sum(out.values())
    out["per_token"] = out["total"] / max(tokens, 1)
    return out


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Expected distinct experts one MoE layer reads for num_tokens tokens routed independently and
    uniformly (top_k of num_experts each): E * (1 - (1 - k/E)^B). The decode section measures the real
    count from the router and keeps this as the fallback and for reference."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def kda_state_bytes_per_request(config: KimiLinearConfig, conv_dtype_bytes: int = 2) -> int:
    """One request's KDA state: per KDA layer the fp32 recurrent state h*dk*dk*4 plus the conv
    window 3*qkv*(W-1)*conv_dtype_bytes."""
    per_layer = (config.linear_num_heads * config.linear_head_dim ** 2 * 4
                 + 3 * config.kda_qkv_dim * (config.short_conv_kernel_size - 1) * conv_dtype_bytes)
    return len(config.kda_layer_ids) * per_layer


def weight_bytes(config: KimiLinearConfig, dtype_bytes: int = 2) -> dict[str, int]:
    """Checkpoint bytes by kind: routed experts (all), one routed expert, embedding, lm_head, and the
    rest (KDA / MLA / norms / dense MLP / shared experts / routers). float32 tensors count 4 bytes."""
    out = dict(routed_experts=0, embedding=0, lm_head=0, rest=0)
    for name, (shape, kind) in hub_tensor_shapes(config).items():
        key = ("routed_experts" if ".experts." in name else "embedding" if name == "model.embed_tokens.weight"
               else "lm_head" if name == "lm_head.weight" else "rest")
        out[key] += math.prod(shape) * (4 if kind == FLOAT32 else dtype_bytes)
    if config.tie_word_embeddings:
        out["lm_head"] = config.vocab_size * config.hidden_size * dtype_bytes  # reads the tied table
    out["per_expert"] = 3 * config.hidden_size * config.moe_intermediate_size * dtype_bytes
    return out


def decode_step_bytes(config: KimiLinearConfig, batch: int, total_context: float, distinct_experts: float,
                      dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences must move at least.

    weights_rest + lm_head: read once per step; embedding: batch rows of d;
    routed_experts: distinct_experts (mean per MoE layer) * num_moe_layers * 3*d*I*dtype_bytes;
    latents_read: total_context (keys attended, summed over the batch, new token included)
      * (kv_lora_rank + rope) * dtype_bytes * num_mla_layers; latents_written: batch new entries;
    kda_state: batch * kda_state_bytes_per_request * 2 (read and written back).
    """
    w = weight_bytes(config, dtype_bytes)
    num_moe = sum(1 for t in config.mlp_layer_types if t != DENSE_MLP)
    latent = config.latent_dim * dtype_bytes * len(config.mla_layer_ids)
    out = dict(
        weights_rest=float(w["rest"]), lm_head=float(w["lm_head"]),
        embedding=float(batch * config.hidden_size * dtype_bytes),
        routed_experts=float(distinct_experts * num_moe * w["per_expert"]),
        latents_read=float(total_context * latent), latents_written=float(batch * latent),
        kda_state=float(2 * batch * kda_state_bytes_per_request(config, dtype_bytes)),
    )
    out["total"] = sum(out.values())
    return out
