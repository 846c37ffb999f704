"""Depthwise causal short convolution (KDA's q/k/v conv) over packed sequences with pooled windows.

Prefill runs the torch reference everywhere. Decode runs the Triton kernel (`triton_conv`) on CUDA when
triton imports, the reference elsewhere; tests run the kernel on CPU in the Triton interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.ops.conv import naive
from deltaserve.ops.conv.naive import causal_conv1d_prefill
from deltaserve.ops.triton_kernels import cuda_kernels


def _decode_impl(device_type: str) -> Callable[..., torch.Tensor]:
    kernels = cuda_kernels("deltaserve.ops.conv.triton_conv") if device_type == "cuda" else None
    return kernels.causal_conv1d_decode if kernels is not None else naive.causal_conv1d_decode


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """x: [B, D], weight: [D, W], pool [S, D, W - 1], slots [B] -> y [B, D] (see naive.causal_conv1d_decode)."""
    return _decode_impl(x.device.type)(x, weight, conv_state_pool, state_slots, activation)


__all__ = ["causal_conv1d_decode", "causal_conv1d_prefill"]
