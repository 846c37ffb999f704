"""Mixture-of-experts references: Kimi's grouped sigmoid router and the expert loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# transformers adds this to the sum of the chosen weights before renormalising
RENORM_EPS = 1e-20
# a group is scored by the sum of its best two (bias-corrected) expert scores
GROUP_SCORE_TOP = 2


def grouped_topk(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose top_k experts per token among the experts of the topk_group best groups.

    router_logits: [T, E] float32, e_score_correction_bias: [E] float32.
    Returns (topk_weights [T, top_k] float32, topk_ids [T, top_k] long).

    Scores are sigmoid(logits). The bias only steers the choice (of groups and of experts); the
    weights are the unbiased scores of the chosen experts, optionally renormalised to sum to one,
    then multiplied by routed_scaling_factor. The order along top_k is unspecified.
    """
    num_tokens, num_experts = router_logits.shape
    if num_experts % num_expert_group:
        raise ValueError(f"num_expert_group={num_expert_group} must divide num_experts={num_experts}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
    group_size = num_experts // num_expert_group
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(
            f"num_experts_per_token={top_k} must be in [1, topk_group * experts per group = {topk_group * group_size}]"
        )
    scores = router_logits.float().sigmoid()
    choice = scores + e_score_correction_bias.float()
    if topk_group < num_expert_group:  # with every group kept the mask is all ones
        grouped = choice.view(num_tokens, num_expert_group, group_size)
        group_scores = grouped.topk(min(GROUP_SCORE_TOP, group_size), dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return topk_weights * routed_scaling_factor, topk_ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of the chosen SwiGLU experts, one expert at a time.

    x: [T, H], w13: [E, 2I, H] (rows [0, I) gate w1, rows [I, 2I) up w3), w2: [E, H, I],
    topk_weights: [T, K] float32, topk_ids: [T, K] long -> [T, H] in x.dtype.
    expert_map (expert parallelism): [E_global] long, global expert id -> index into this rank's
    w13/w2, or -1 for an expert another rank holds; topk_ids are then global ids, and pairs routed
    to other ranks' experts contribute nothing here (a token with none of its experts here gets zeros).

    out[t] = sum_k topk_weights[t, k] * w2[e] (silu(w1[e] x[t]) * w3[e] x[t]), e = topk_ids[t, k].
    Like transformers' expert loop, experts are visited in ascending id; each expert's output is
    scaled in float32 (the weights' dtype), cast to x.dtype and index-added into the result.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1) if expert_map is None else expert_map[topk_ids.reshape(-1)]
    flat_weights = topk_weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        pairs = order[start : start + count]
        start += count
        if expert < 0:  # held by another expert-parallel rank
            continue
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * flat_weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
