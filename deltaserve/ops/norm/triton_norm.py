"""Triton RMS norms for the GPU path: residual add + RMSNorm in one pass, and the sigmoid-gated KDA norm.

Each program normalises one row. The arithmetic follows the references in `naive.py` step for step
(the residual sum rounded to the model dtype, the statistics in float32, the normalised row rounded
before the scale), so in float32 the results agree with the references to rounding, and in bf16 to
one rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    D, stride_x, stride_r, stride_o, stride_ro, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as the eager add would be
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = w * (x * inv_rms) * tl.sigmoid(g)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, D] view with unit column stride (a copy only if it has none)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (or of x + residual), as `naive.rms_norm` / `naive.add_rms_norm` compute it.

    x: [..., D]; weight: [D]; residual: like x or None.
    Returns normed [..., D] in promote(x, weight) dtype; with a residual, (normed, x + residual in x.dtype).
    """
    D = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    has_residual = residual is not None
    # without a residual the kernel never touches these two: x2 stands in for them
    r2 = _rows(residual) if has_residual else x2
    residual_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if has_residual else x2
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, residual_out, D, x2.stride(0), r2.stride(0), out.stride(0),
            residual_out.stride(0), eps, HAS_RESIDUAL=has_residual, BLOCK_D=block,
            num_warps=max(1, min(16, block // 256)),
        )
    if not has_residual:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The KDA output norm, as `naive.gated_rms_norm`: x, gate [T, H, D], weight [D] -> [T, H, D] x.dtype."""
    D = x.shape[-1]
    x2, g2 = x.reshape(-1, D).contiguous(), gate.reshape(-1, D).contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        _gated_rms_norm_kernel[(x2.shape[0],)](x2, g2, weight, out, D, eps, BLOCK_D=block,
                                               num_warps=max(1, min(8, block // 128)))
    return out.view(x.shape)
