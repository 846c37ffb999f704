"""The reference SwiGLU activation (what `triton_silu_mul` must match)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I], gate then up along the last dim -> [..., I] in gate_up.dtype: silu(gate),
    rounded to the dtype, times up, rounded again (two eager ops, each computing in float32)."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])
