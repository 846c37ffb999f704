"""Kimi Delta Attention ops: references (`naive`, `chunk`) and the varlen entry points the model calls."""

from deltaserve.ops.kda.chunk import chunk_kda_torch
from deltaserve.ops.kda.dispatch import KDAGate, kda_decode, kda_prefill, kda_verify, select_backend
from deltaserve.ops.kda.naive import kda_gate, l2norm, naive_recurrent_kda

__all__ = [
    "KDAGate",
    "kda_gate",
    "chunk_kda_torch",
    "kda_decode",
    "kda_prefill",
    "kda_verify",
    "l2norm",
    "naive_recurrent_kda",
    "select_backend",
]
