"""Triton decode step of the depthwise causal short convolution, over pooled windows, in place.

One program handles BLOCK_D channels of one sequence: it reads the sequence's window from its pool
slot, forms the output from the window and the new input, writes the shifted window back to the same
slot, and applies the activation. It replaces the gather, concatenation, reduction and scatter of the
reference (`naive.causal_conv1d_decode`) with one kernel, and captures into CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_decode_kernel(
    x_ptr, weight_ptr, pool_ptr, slots_ptr, out_ptr,
    D, stride_x, stride_o, stride_pool_slot, stride_pool_d, stride_w,
    WIDTH: tl.constexpr, APPLY_SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    window = pool_ptr + slot * stride_pool_slot + cols * stride_pool_d
    x_new = tl.load(x_ptr + seq * stride_x + cols, mask=mask, other=0.0)
    # taps 0..WIDTH-2 see the window (oldest first), the last tap sees the new input
    acc = tl.load(weight_ptr + cols * stride_w + (WIDTH - 1), mask=mask, other=0.0).to(tl.float32)
    acc = acc * x_new.to(tl.float32)
    previous = tl.load(window, mask=mask, other=0.0)
    for j in tl.static_range(WIDTH - 1):
        tap = tl.load(weight_ptr + cols * stride_w + j, mask=mask, other=0.0).to(tl.float32)
        acc += tap * previous.to(tl.float32)
        if j + 1 < WIDTH - 1:
            following = tl.load(window + (j + 1), mask=mask, other=0.0)
        else:
            following = x_new.to(previous.dtype)
        tl.store(window + j, following, mask=mask)  # shift left by one: after this read, never read again
        previous = following
    if APPLY_SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + seq * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
    block_d: int = 256,
) -> torch.Tensor:
    """One new token for each of B sequences; shifts each pooled window by one, in place.

    Args:
        x: [B, D] (rows may be strided).
        weight: [D, W] (or [D, 1, W]).
        conv_state_pool: [S, D, W - 1] windows, oldest first, unit stride along the window.
        state_slots: [B] long or int32, distinct.
        activation: "silu" or None.
    Returns:
        y: [B, D], dtype of x.
    """
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation={activation!r} is not supported; use 'silu' or None")
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    B, D = x.shape
    W = weight.shape[1]
    if weight.shape[0] != D or conv_state_pool.shape[1:] != (D, W - 1):
        raise ValueError(
            f"conv shapes disagree: x {list(x.shape)}, weight {list(weight.shape)}, pool {list(conv_state_pool.shape)}"
        )
    if W < 2 or conv_state_pool.stride(2) != 1 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the triton conv decode needs W >= 2 and unit stride along channels, taps and windows")
    out = torch.empty(B, D, dtype=x.dtype, device=x.device)
    if B:
        grid = (B, triton.cdiv(D, block_d))
        _conv_decode_kernel[grid](
            x, weight, conv_state_pool, state_slots, out,
            D, x.stride(0), out.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1), weight.stride(0),
            WIDTH=W, APPLY_SILU=activation is not None, BLOCK_D=block_d,
        )
    return out
