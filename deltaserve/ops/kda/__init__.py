"""Kimi Delta Attention ops: references (`naive`, `chunk`) and the varlen entry points the model calls."""

from deltaserve.ops.kda.chunk import chunk_kda_torch
from deltaserve.ops.kda.dispatch import kda_decode, kda_prefill, select_backend
from deltaserve.ops.kda.naive import l2norm, naive_recurrent_kda

__all__ = [
    "chunk_kda_torch",
    "kda_decode",
    "kda_prefill",
    "l2norm",
    "naive_recurrent_kda",
    "select_backend",
]
