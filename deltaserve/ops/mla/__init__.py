"""Multi-head latent attention over a paged latent cache [num_blocks, block_size, R + P].

The API is the same on every device. `paged_mla_decode` dispatches by device: the Triton split-KV
kernel (`triton_decode`) on CUDA, the torch reference (`naive`) elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from deltaserve.ops.mla import naive
from deltaserve.ops.mla.naive import (
    attention_expanded,
    gather_latents,
    merge_attention_states,
    merge_partial_attentions,
    write_latents,
)
from deltaserve.ops.triton_kernels import cuda_kernels

PagedDecodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def paged_mla_decode_impl(device: torch.device) -> PagedDecodeFn:
    """The paged_mla_decode implementation for tensors on `device`.

    CUDA: the Triton split-KV kernel (`triton_decode.paged_mla_decode`) when triton imports, else the
    torch reference. Other devices: the torch reference (tests run the Triton kernel on CPU through
    the Triton interpreter, tests/ops/test_mla_triton.py). Cached per device: import is tried once.
    """
    kernels = cuda_kernels("deltaserve.ops.mla.triton_decode") if device.type == "cuda" else None
    return kernels.paged_mla_decode if kernels is not None else naive.paged_mla_decode


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent: [B, H, R], q_pe: [B, H, P], kv_cache: [num_blocks, block_size, R + P],
    block_tables: [B, max_blocks] long, seq_lens: [B] long, max_seq_len: a host-side bound on seq_lens
    (fixed under CUDA graphs) or None -> (o_latent [B, H, R] float32, lse [B, H] float32).
    See naive.paged_mla_decode."""
    impl = paged_mla_decode_impl(q_latent.device)
    return impl(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale, kv_lora_rank, max_seq_len=max_seq_len)


__all__ = [
    "attention_expanded",
    "gather_latents",
    "merge_attention_states",
    "merge_partial_attentions",
    "paged_mla_decode",
    "paged_mla_decode_impl",
    "write_latents",
]
