"""Triton kernel for the SwiGLU activation: silu(gate) * up from a fused [gate | up] GEMM output, in one
pass.

The reference (`naive.silu_and_mul`) is two eager kernels over strided halves: SiLU writes a rounded
[N, I] tensor that the multiply reads back. On a 32k prefill of the 48B's layers on an H100 the pair took
about 1.85 ms a MoE layer (8 of each per step, 14.8 ms of the step's 199 ms of kernels) for about 2.7 GB
of traffic; one pass moves 1.6 GB. Each program handles BLOCK columns of one row: it loads the gate and up
halves, computes SiLU in float32, rounds it to the input dtype (as the reference's SiLU output is
rounded), multiplies by up in float32 and rounds once more. Captures into CUDA graphs (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up: [..., 2I], gate then up along the last dim (last dim contiguous) -> [..., I] in
    gate_up.dtype: round(round(silu(gate)) * up), as `naive.silu_and_mul`."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate then up), got {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inter:
        block = min(block, triton.next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](rows, out, inter, rows.stride(0), out.stride(0), BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)
