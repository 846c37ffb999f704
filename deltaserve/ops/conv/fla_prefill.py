"""Prefill of KDA's short convolution through fla's Triton kernel (`fla.modules.causal_conv1d`).

fla keeps a window of W columns per sequence, of which it reads the last W - 1 as the inputs before the
first token (oldest first) and writes the last W inputs back; the pool here keeps those W - 1 columns.
So the pooled windows go in with an unused zero column in front and come back without the first
column. The torch reference (`naive.causal_conv1d_prefill`) is the contract and the test oracle; on a
32k prompt of the 48B's layers it ran as about 25 elementwise kernels over float32 [T, 3 * H * K]
tensors, some 15 ms a layer on an H100 (docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deltaserve.ops.conv.naive import initial_windows


@functools.cache
def _fla_causal_conv1d() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


def causal_conv1d_prefill_fla(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `naive.causal_conv1d_prefill` (x: [T, D] CUDA, weight [D, W] or [D, 1, W], pool [S, D, W - 1],
    slots [N], has_initial_state [N] -> y [T, D] in x.dtype, the slots' windows updated in place);
    cu_seqlens_cpu: the offsets on the host, which spare fla a device sync."""
    slots = state_slots.to(device=conv_state_pool.device, dtype=torch.long)
    if slots.numel() == 0:
        return x.new_zeros(x.shape)
    taps = weight.reshape(weight.shape[0], -1)  # [D, W]
    windows = initial_windows(conv_state_pool, slots, has_initial_state)  # [N, D, W - 1]
    initial = F.pad(windows, (1, 0)).to(x.dtype)  # [N, D, W]: column 0 is never read
    y, final = _fla_causal_conv1d()(
        x.unsqueeze(0), weight=taps.to(x.dtype), initial_state=initial, output_final_state=True,
        activation=activation, cu_seqlens=cu_seqlens.to(device=x.device, dtype=torch.long),
        cu_seqlens_cpu=None if cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
    )
    conv_state_pool.index_copy_(0, slots, final[..., 1:].to(conv_state_pool.dtype))
    return y.squeeze(0)
