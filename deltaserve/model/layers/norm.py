"""RMSNorm as a module (the math lives in deltaserve.ops.norm)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.ops.norm import add_rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden_size] -> normed, same shape and dtype.

        With a residual (like x): (norm(x + residual), x + residual), in one kernel on the GPU.
        """
        return add_rms_norm(x, self.weight, self.eps, residual)
