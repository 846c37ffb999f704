"""Routed experts as two grouped GEMMs (`torch._grouped_mm`) over expert-sorted (token, k) pairs.

Same contract as `naive.fused_moe`. Steps, all on the device and free of host syncs:
1. permute: stable-sort the T*K (token, k) pairs by expert id; `offs[e]` (int32) is the end of
   expert e's rows, found by `searchsorted` on the sorted ids (no `bincount`: on CUDA it reads
   max(ids) back to the host to size its output);
2. gather x into expert-contiguous rows [T*K, H];
3. grouped GEMM with w13^T -> [T*K, 2I]; silu(gate) * up -> [T*K, I] (`ops.activation`, one Triton
   kernel on CUDA); grouped GEMM with w2^T -> [T*K, H];
4. un-permute into (token, k) order, scale by the routing weight in float32 and cast to x.dtype
   (as the reference does per expert), then sum over k: [T, K, H] -> [T, H] (`combine_pairs`; on CUDA
   one Triton kernel, `triton_combine.py`). No atomics, so the result is deterministic.

Which path runs (`grouped_mm_supported`):
- CUDA with compute capability 9.x or 10.x (H100/H200, B200), bf16 x/w13/w2: PyTorch's CUTLASS
  grouped kernel, which reads `offs` on the device. Capturable in a CUDA graph for a fixed T.
- CPU with torch >= 2.9: `torch._grouped_mm`'s composite fallback (one mm per expert), any of
  fp32/bf16/fp16. Deterministic, and measured no slower than the reference loop (1.2-4x faster on
  small shapes, one thread); used so that CPU tests cover this path.
- Anything else (CUDA fp32/fp16, sm80/sm89/sm120, torch without the op, dims or pointers not
  16-byte aligned, 1024 or more experts): `naive.fused_moe`. On CUDA torch's own fallback for
  those cases copies `offs` to the host per call, so it would be no better than the loop, and
  neither is capturable: keep MoE layers out of CUDA graphs there.
"""

from __future__ import annotations

import functools

import torch

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.moe import naive
from deltaserve.ops.triton_kernels import cuda_kernels

# TMA (CUDA) and the op's stride checks (every device) need 16-byte aligned row strides
ALIGN_BYTES = 16
# the CUTLASS kernel sets up its per-group arguments with one thread per group in one block
MAX_GROUPS = 1023
# torch._grouped_mm's fast kernel exists for these CUDA major versions only (sm90, sm100)
FAST_CUDA_MAJORS = (9, 10)
# operands past 2^31 elements crash the CUDA kernel (torchtitan issue #1932: an illegal memory access
# at [525312, 4096], likely an int32 offset); bigger batches run in token chunks below this
MAX_OPERAND_ELEMENTS = 2**31 - 1


@functools.cache
def _grouped_mm_runs_on_cpu() -> bool:
    """torch 2.8 has the op but no CPU kernel; torch < 2.8 has no op at all."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    a = torch.ones(4, 8)
    b = torch.ones(2, 8, 4)
    try:
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32))
    except (NotImplementedError, RuntimeError):
        return False
    return bool((out == 8).all())


@functools.cache
def _fast_cuda_device(index: int) -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(index)[0] in FAST_CUDA_MAJORS


def _aligned(t: torch.Tensor) -> bool:
    """Rows contiguous, base pointer and every other stride a multiple of 16 bytes."""
    return t.stride(-1) == 1 and t.data_ptr() % ALIGN_BYTES == 0 and all(
        s == 1 or (s * t.element_size()) % ALIGN_BYTES == 0 for s in t.stride()
    )


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `grouped_fused_moe` can run on these operands without a host sync.

    x: [T, H], w13: [E, 2I, H], w2: [E, H, I]. Host-side checks only (shapes, strides, dtypes, device).
    """
    num_experts, hidden, inter = w13.shape[0], x.shape[-1], w2.shape[-1]
    if not (x.device == w13.device == w2.device and x.dtype == w13.dtype == w2.dtype):
        return False
    row_bytes = (hidden * x.element_size(), inter * x.element_size())
    if num_experts > MAX_GROUPS or any(b % ALIGN_BYTES for b in row_bytes):
        return False
    if not (_aligned(w13) and _aligned(w2)):
        return False
    if x.device.type == "cuda":
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        return x.dtype == torch.bfloat16 and _fast_cuda_device(index)
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _grouped_mm_runs_on_cpu()
    return False


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs by expert, on the device.

    topk_ids: [T, K] long, values in [0, E).
    Returns (order [T*K] long: flat pair indices t*K + k sorted by expert, stable;
             offs [E] int32: offs[e] = number of pairs routed to experts 0..e, i.e. expert e's row end).
    """
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts, device=topk_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return order, offs


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Global expert ids [T, K] -> this rank's expert indices [T, K], with every expert another rank
    holds (expert_map -1) sent to `num_local_experts`, one past the last: it sorts after every local
    expert, so its pairs fall past offs[-1], where no GEMM group reads or writes."""
    local = expert_map[topk_ids]
    return torch.where(local < 0, num_local_experts, local)


def grouped_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The grouped-GEMM path, unconditionally (the caller has checked `grouped_mm_supported`).

    x: [T, H], w13: [E, 2I, H] (rows [0, I) gate w1, rows [I, 2I) up w3), w2: [E, H, I],
    topk_weights: [T, K] float32, topk_ids: [T, K] long -> [T, H] in x.dtype.
    expert_map: as in `naive.fused_moe` (expert parallelism: [E_global] long, -1 for another rank's
    expert); the rows of other ranks' pairs are zeroed on the device, without a sync.
    Ids outside [0, E) are not checked (that would need a sync); their rows come out as garbage.
    Batches whose [T*K, max(H, 2I)] operand would pass MAX_OPERAND_ELEMENTS run in token chunks.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w13.shape[0], x.shape[-1], w2.shape[-1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    chunk = max(1, MAX_OPERAND_ELEMENTS // (top_k * max(hidden, 2 * inter)))
    if num_tokens > chunk:  # about 116k tokens on Kimi-Linear-48B-A3B
        return torch.cat([
            grouped_fused_moe(x[s : s + chunk], w13, w2, topk_weights[s : s + chunk], topk_ids[s : s + chunk],
                              expert_map)
            for s in range(0, num_tokens, chunk)
        ])
    if expert_map is not None:
        topk_ids = local_expert_ids(topk_ids, expert_map, num_experts)
    order, offs = permute_by_expert(topk_ids, num_experts)
    x_sorted = x.index_select(0, order // top_k)  # [T*K, H]
    gate_up = torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offs)  # [T*K, 2I]
    act = silu_and_mul(gate_up)  # [T*K, I]
    del gate_up
    y_sorted = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [T*K, H]
    del act
    if expert_map is not None:  # rows past offs[-1] (other ranks' pairs) were never written
        rows = torch.arange(y_sorted.shape[0], device=y_sorted.device)
        y_sorted.masked_fill_((rows >= offs[-1]).unsqueeze(-1), 0)
    kernels = cuda_kernels("deltaserve.ops.moe.triton_combine") if y_sorted.device.type == "cuda" else None
    if kernels is not None:
        return kernels.combine_pairs(y_sorted, order, topk_weights)
    # x_sorted is dead after the first GEMM; its memory holds the pairs in (token, k) order
    return combine_pairs(y_sorted, order, topk_weights, out=x_sorted)


def combine_pairs(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The combine of the expert outputs, the reference of `triton_combine.combine_pairs`.

    y_sorted: [T*K, H] rows in expert order (row i is pair order[i] = t*K + k), order: [T*K] long,
    topk_weights: [T, K] float32; out: a [T*K, H] buffer of y_sorted's dtype to hold the pairs, or None
    -> [T, H] in y_sorted.dtype: each row times its weight in float32, rounded, summed over k.
    """
    num_tokens, top_k = topk_weights.shape
    buffer = torch.empty_like(y_sorted) if out is None else out
    pairs = buffer.index_copy_(0, order, y_sorted).view(num_tokens, top_k, y_sorted.shape[1])
    # in-place mul computes in float32 (the weights' dtype) and rounds to the pairs' dtype, like the loop
    pairs.mul_(topk_weights.unsqueeze(-1))
    return pairs.sum(dim=1)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMMs where `grouped_mm_supported`, else the reference expert loop.

    x: [T, H], w13: [E, 2I, H] ([w1; w3]), w2: [E, H, I], topk_weights: [T, K] float32,
    topk_ids: [T, K] long -> [T, H] in x.dtype: sum_k weight_k * w2_e(silu(w1_e x) * w3_e x).
    expert_map: see `naive.fused_moe` (expert parallelism: only this rank's experts contribute).
    """
    if grouped_mm_supported(x, w13, w2):
        return grouped_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map)
    return naive.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map)
