"""The SwiGLU activation of the MLPs and the routed experts: silu(gate) * up over a fused [gate | up]
GEMM output.

The API is the same on every device: on CUDA the Triton kernel in `triton_silu_mul` runs (when triton
imports), elsewhere the reference in `naive`. Tests run the kernel on CPU in the Triton interpreter.
"""

from __future__ import annotations

import torch

from deltaserve.ops.activation import naive
from deltaserve.ops.triton_kernels import cuda_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I], gate then up along the last dim -> [..., I] (see naive.silu_and_mul)."""
    kernels = cuda_kernels("deltaserve.ops.activation.triton_silu_mul") if gate_up.device.type == "cuda" else None
    return (kernels if kernels is not None else naive).silu_and_mul(gate_up)


__all__ = ["silu_and_mul"]
