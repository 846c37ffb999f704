"""RMS norms: the plain one (layer norms, latent norms, with an optional residual add) and the
sigmoid-gated KDA output norm.

The API is the same on every device: on CUDA the Triton kernels in `triton_norm` run (when triton
imports), elsewhere the references in `naive`. Tests run the kernels on CPU in the Triton interpreter.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deltaserve.ops.norm import naive
from deltaserve.ops.triton_kernels import cuda_kernels


def _impl(x: torch.Tensor) -> ModuleType:
    kernels = cuda_kernels("deltaserve.ops.norm.triton_norm") if x.device.type == "cuda" else None
    return kernels if kernels is not None else naive


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] (see naive.rms_norm)."""
    return _impl(x).add_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (+ residual): normed, or (normed, x + residual) (see naive.add_rms_norm)."""
    return _impl(x).add_rms_norm(x, weight, eps, residual)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [T, H, D], weight: [D] -> [T, H, D] in x.dtype (see naive.gated_rms_norm)."""
    return _impl(x).gated_rms_norm(x, gate, weight, eps)


__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]
