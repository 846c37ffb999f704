"""Triton kernel for the routed experts' combine: expert-sorted output rows back to their tokens, each
scaled by its routing weight and summed over the token's k experts, in one pass.

One program handles BLOCK_H columns of one token: for each of its k pairs it reads the pair's row of the
sorted GEMM output, multiplies by the routing weight in float32 and rounds to the output dtype (as the
reference's in-place multiply does), and adds in float32; the sum is rounded once. The reference
(`grouped.combine_pairs`: an index_copy into token order, a mixed-dtype multiply, a sum over k) took
about 5.6 ms a MoE layer on a 32k prefill of the 48B's layers on an H100, for about 1.5 GB of traffic.
Captures into CUDA graphs (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(
    y_ptr, row_of_pair_ptr, weight_ptr, out_ptr,
    H, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(row_of_pair_ptr + token * TOP_K + k).to(tl.int64)
        weight = tl.load(weight_ptr + token * TOP_K + k).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
        acc += (y.to(tl.float32) * weight).to(y.dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_pairs(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                  block_h: int = 512) -> torch.Tensor:
    """y_sorted: [T*K, H] rows in expert order (row i is pair order[i] = t*K + k), order: [T*K] long,
    topk_weights: [T, K] float32 -> [T, H] in y_sorted.dtype: sum_k round(weight[t, k] * row of (t, k))."""
    num_tokens, top_k = topk_weights.shape
    hidden = y_sorted.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=y_sorted.dtype, device=y_sorted.device)
    if num_tokens == 0:
        return out
    positions = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    row_of_pair = torch.empty_like(order).scatter_(0, order, positions)  # the inverse permutation
    weights = topk_weights.to(torch.float32).contiguous()
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    _combine_kernel[grid](y_sorted, row_of_pair, weights, out, hidden, y_sorted.stride(0), out.stride(0),
                          TOP_K=top_k, BLOCK_H=block_h)
    return out
