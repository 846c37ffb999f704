"""The grouped router and the expert loop against transformers' Kimi Linear modules and float64 loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import KimiLinearConfig as HFConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearExperts, KimiLinearTopkRouter

from deltaserve.ops.moe import fused_moe, grouped_topk
from deltaserve.ops.moe import naive as moe_naive


def _hf_config(experts: int, top_k: int, groups: int, topk_group: int, renormalize: bool,
               hidden: int = 32, inter: int = 16) -> HFConfig:
    cfg = HFConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_token=top_k,
        num_expert_group=groups, topk_group=topk_group, moe_renormalize=renormalize,
        routed_scaling_factor=2.446, num_attention_heads=2, num_key_value_heads=2,
    )
    cfg._experts_implementation = "eager"
    return cfg


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


ROUTER_CASES = [  # experts, top_k, groups, topk_group, renormalize
    (16, 4, 4, 2, True),
    (16, 4, 4, 2, False),
    (32, 6, 8, 3, True),
    (24, 3, 6, 6, False),
    (8, 2, 1, 1, True),
    (8, 2, 1, 1, False),
]


@pytest.mark.parametrize(("experts", "top_k", "groups", "topk_group", "renormalize"), ROUTER_CASES)
def test_grouped_topk_matches_transformers_router(
    experts: int, top_k: int, groups: int, topk_group: int, renormalize: bool
) -> None:
    hidden, tokens = 32, 40
    gen = torch.Generator().manual_seed(experts * 100 + top_k * 10 + groups)
    router = KimiLinearTopkRouter(_hf_config(experts, top_k, groups, topk_group, renormalize, hidden))
    x = torch.randn(tokens, hidden, generator=gen)
    bias = 0.3 * torch.randn(experts, generator=gen)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen) / hidden**0.5)
        router.e_score_correction_bias.copy_(bias)
        logits, hf_weights, hf_ids = router(x)
    weights, ids = grouped_topk(logits, bias, top_k, groups, topk_group, renormalize, 2.446)
    assert weights.dtype == torch.float32 and ids.dtype == torch.long and ids.shape == (tokens, top_k)
    weights, ids = _sorted_by_id(weights, ids)
    hf_weights, hf_ids = _sorted_by_id(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-6)

    # the case is meaningful: the bias changes some choices, and choices respect the group limit
    _, unbiased_ids = grouped_topk(logits, torch.zeros_like(bias), top_k, groups, topk_group, renormalize, 2.446)
    assert not torch.equal(unbiased_ids.sort(dim=-1).values, ids)
    groups_used = (ids // (experts // groups)).tolist()
    assert all(len(set(row)) <= topk_group for row in groups_used)
    # weights are the unbiased sigmoid scores of the chosen experts
    chosen = logits.sigmoid().gather(1, ids)
    if renormalize:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, 2.446 * chosen, rtol=1e-6, atol=1e-6)


def test_grouped_topk_rejects_bad_groups() -> None:
    logits = torch.randn(3, 12)
    with pytest.raises(ValueError, match="num_expert_group=5"):
        grouped_topk(logits, torch.randn(12), 2, 5, 1, True, 1.0)
    with pytest.raises(ValueError, match="num_experts_per_token=7"):
        grouped_topk(logits, torch.randn(12), 7, 4, 2, True, 1.0)


def _moe_inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    # a few experts are never chosen (ids drawn from the first experts - 2)
    ids = torch.stack([torch.randperm(experts - 2, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, w13, w2, weights, ids


def _dense_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Per token, per chosen expert, in float64."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            w1, w3 = w13[e, :inter].double(), w13[e, inter:].double()
            xt = x[t].double()
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(w1 @ xt) * (w3 @ xt)))
    return out


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (13, 3), (32, 1)])
def test_fused_moe_matches_float64_loop(tokens: int, top_k: int) -> None:
    x, w13, w2, weights, ids = _moe_inputs(tokens, hidden=24, inter=20, experts=10, top_k=top_k, seed=tokens)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _dense_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_transformers_experts(dtype: torch.dtype) -> None:
    hidden, inter, experts, top_k = 32, 16, 8, 2
    x, w13, w2, weights, ids = _moe_inputs(19, hidden, inter, experts, top_k, seed=7)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    hf = KimiLinearExperts(_hf_config(experts, top_k, 1, 1, True, hidden, inter)).to(dtype)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        expected = hf(x, ids, weights)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_fused_moe_empty_batch_and_dispatch() -> None:
    x, w13, w2, weights, ids = _moe_inputs(5, hidden=8, inter=4, experts=6, top_k=2, seed=11)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), moe_naive.fused_moe(x, w13, w2, weights, ids))
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 8)
