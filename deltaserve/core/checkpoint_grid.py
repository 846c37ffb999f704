"""The one grid KDA state checkpoints sit on.

Rungs, the prompt-end anchor, the end-of-sequence anchor and demand checkpoints are all taken at
multiples of `checkpoint_grid(block_size)`: the least common multiple of the KV block size (a joint
hit ends on a block edge) and the chunk of fla's chunked KDA kernels (so a later change can take an
image at a chunk edge inside a long prefill). A feature that needs coarser edges multiplies the grid
(a DCP block, an offload chunk) instead of adding a rule of its own.
"""

from __future__ import annotations

import math

KERNEL_CHUNK_TOKENS = 64  # the chunk of fla's chunked KDA kernels


def checkpoint_grid(block_size: int, kernel_chunk: int = KERNEL_CHUNK_TOKENS, coarser: int = 1) -> int:
    """Tokens between the places a checkpoint may sit (64 for every block size up to 64); `coarser`
    is a feature's own edge the grid must also land on (the offload tier's chunk: a state image off
    that grid could never be stored beside the KV chunk that ends there)."""
    return math.lcm(block_size, kernel_chunk, coarser)
