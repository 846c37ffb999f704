"""Where an op's Triton kernels come from on CUDA: one lazy, cached import per kernel module.

Each op folder keeps its Triton kernels in a module of their own (`mla/triton_decode.py`,
`norm/triton_norm.py`, `conv/triton_conv.py`) beside the torch reference. The op dispatches to the
kernels for CUDA tensors when the module imports (triton installed), to the reference otherwise.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def cuda_kernels(module: str) -> ModuleType | None:
    """The kernel module `module` (a dotted name), imported once; None when it cannot import."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
