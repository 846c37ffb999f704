"""Depthwise causal short convolution (KDA's q/k/v conv) over packed sequences with pooled windows.

Prefill runs fla's Triton kernel (`fla_prefill`) on CUDA where the KDA backend is fla, the torch reference
elsewhere. Decode runs our Triton kernel (`triton_conv`) on CUDA when triton imports, the reference
elsewhere; tests run that kernel on CPU in the Triton interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.ops.conv import naive
from deltaserve.ops.conv.fla_prefill import causal_conv1d_prefill_fla
from deltaserve.ops.kda.dispatch import select_backend  # the KDA backend decides for its conv too
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


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, D] packed sequences, weight [D, W], pool [S, D, W - 1], slots [N], has_initial_state [N]
    -> y [T, D] (see naive.causal_conv1d_prefill); cu_seqlens_cpu: the offsets on the host, if at hand."""
    if select_backend(x.device) == "fla":
        return causal_conv1d_prefill_fla(x, weight, cu_seqlens, conv_state_pool, state_slots, has_initial_state,
                                         activation, cu_seqlens_cpu)
    return naive.causal_conv1d_prefill(x, weight, cu_seqlens, conv_state_pool, state_slots, has_initial_state,
                                       activation)


__all__ = ["causal_conv1d_decode", "causal_conv1d_prefill"]
