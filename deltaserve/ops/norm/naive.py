"""RMSNorm references, matching transformers' Kimi Linear norms in compute dtype and cast order."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, with a learned scale.

    x: [..., D], weight: [D] -> [..., D]. The statistics and the normalisation run in float32;
    the normalised values are cast back to x.dtype before the scale, as transformers'
    KimiLinearRMSNorm does, so the result has the promoted dtype of weight and x.
    """
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * inv_rms).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` of x, or of x + residual, for a residual stream carried beside the hidden states.

    x: [..., D]; weight: [D]; residual: like x, or None.
    Returns rms_norm(x) without a residual; with one, (rms_norm(x + residual), x + residual), the sum
    in x.dtype, exactly as `hidden = residual + x; rms_norm(hidden)` computes it.
    """
    if residual is None:
        return rms_norm(x, weight, eps)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The KDA output norm: RMSNorm of x over D, times weight, times sigmoid(gate).

    x, gate: [T, H, D], weight: [D] -> [T, H, D] in x.dtype. Everything (weight and gate included)
    is computed in float32 and cast to x.dtype once at the end, as transformers'
    KimiLinearRMSNormGated does.
    """
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight.float() * (xf * inv_rms)
    return (y * torch.sigmoid(gate.float())).to(x.dtype)
