"""Mixture of experts: the grouped sigmoid router and the routed-expert computation.

`fused_moe` dispatches by device: CUDA and CPU run the grouped-GEMM path (`grouped.py`, which itself
falls back to the loop for operands torch._grouped_mm cannot take without a host sync); other devices
run the torch expert loop (`naive.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.ops.moe import grouped, naive
from deltaserve.ops.moe.naive import grouped_topk

# (x, w13, w2, topk_weights, topk_ids, expert_map) -> out
FusedMoEFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def fused_moe_impl(device: torch.device) -> FusedMoEFn:
    """The fused_moe implementation for tensors on `device`.

    CUDA: grouped GEMMs on sm90/sm100 in bf16 (sync-free, graph-capturable), else the loop.
    CPU: grouped GEMMs on torch >= 2.9 (measured no slower than the loop), else the loop.
    The per-call choice is `grouped.grouped_mm_supported`.
    """
    if device.type in ("cuda", "cpu"):
        return grouped.fused_moe
    return naive.fused_moe


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H], w13: [E, 2I, H] ([w1; w3]), w2: [E, H, I], topk_weights: [T, K] float32,
    topk_ids: [T, K] long -> [T, H] in x.dtype: sum_k weight_k * w2_e(silu(w1_e x) * w3_e x).

    expert_map (expert parallelism): [E_global] long, global expert id -> index into this rank's E
    experts or -1; the sum then runs over this rank's experts only (the others' terms are zero)."""
    return fused_moe_impl(x.device)(x, w13, w2, topk_weights, topk_ids, expert_map)


__all__ = ["fused_moe", "fused_moe_impl", "grouped_topk"]
