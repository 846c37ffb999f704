"""Paged absorbed-MLA decode in Triton: split over the context, merged by log-sum-exp.

Same contract as `naive.paged_mla_decode`. Two kernels:

1. `_split_kernel`, grid (head groups, num_kv_splits, B). A program takes BLOCK_H heads of one
   sequence and one contiguous range of its tokens, walks that range BLOCK_N tokens at a time
   through the block table, and runs an online softmax over
   score = scale * (q_latent . c + q_pe . k_pe). The value is the latent c itself, so each cached
   [c, k_pe] row is loaded once per head group and used by both dots. It writes the split's
   normalised o [BLOCK_H, R] and its lse. Head groups are the fastest grid axis so that the programs
   sharing a sequence's latents tend to run side by side and the later ones hit L2.
2. `_merge_kernel`, grid (B, H): the log-sum-exp merge of the splits. Skipped when there is one split
   (the split kernel then writes the outputs directly).

A split covers ceil(ceil(seq_len / num_kv_splits) / BLOCK_N) * BLOCK_N tokens of its own sequence,
so splits are computed on the device from seq_lens; splits past a sequence's end are empty and
write o = 0, lse = -inf. Block-table entries are loaded only for tokens below seq_len.

Dots: bfloat16/float16 tensor cores when q and the cache share that dtype (fp32 accumulation; the
softmax weights are rounded to the cache dtype for the value dot, as flash attention does). Any other
mix is upcast to float32 with exact fp32 ("ieee") dots on CUDA cores: for tests and debugging, not
the serving path (expected compute-bound). 3xTF32 would be faster but spills heavily at R = 512.

CUDA graphs: a call never syncs with the host (the split count comes from shapes: `max_seq_len`,
by default max_blocks * block_size of the block tables), launches one or two kernels and allocates
its outputs, so it can be captured. The split count is a launch shape and is frozen at capture (pass
`num_kv_splits`, or a fixed `max_seq_len`/table width). Replays with any seq_lens, each within its
own blocks, are correct; only the balance of work across splits depends on the captured count.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.ops.mla.naive import check_decode_shapes

_LOG2E = math.log2(math.e)
# Enough programs for about two resident per SM; more splits only add partial-output traffic.
_PROGRAMS_PER_SM = 2
# A split's partial o (BLOCK_H x R float32, written then read back) costs about as much as ~57
# cached tokens per head group at R = 512: keep splits long enough that this stays small.
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 64
DEFAULT_NUM_SMS = 132  # H200; used when the device has no SM count (the CPU interpreter)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes and launch options of the split kernel.

    block_h heads share each latent load; block_n tokens per loop iteration. Every tile dimension
    that enters a dot must be >= 16 (tensor-core minimum).
    """

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"DecodeConfig.{name}={value} must be a power of two >= 16")


DEFAULT_CONFIG = DecodeConfig()  # bf16/fp16 on sm_90 (ptxas): ~230 registers, 55 KiB shared memory, no spills
FP32_CONFIG = DecodeConfig(block_n=16)  # fp32 tiles: block_n=32 spills


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(batch: int, num_head_groups: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per sequence so that batch * num_head_groups * splits fills the GPU.

    Host-only arithmetic on shapes: never more splits than MIN_TOKENS_PER_SPLIT-token pieces of
    max_seq_len, never more than MAX_KV_SPLITS, at least 1.
    """
    programs = max(1, batch * num_head_groups)
    wanted = -(-num_sms * _PROGRAMS_PER_SM // programs)
    by_length = max(1, -(-max_seq_len // MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, by_length, MAX_KV_SPLITS))


@triton.jit
def _split_kernel(
    q_latent_ptr,
    q_pe_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    o_ptr,
    lse_ptr,
    scale_log2,
    num_heads,
    stride_qb,
    stride_qh,
    stride_peb,
    stride_peh,
    stride_kv_block,
    stride_kv_token,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    head_group = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(1)

    heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_ok = offs_r < RANK
    p_ok = offs_p < ROPE

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(
        q_latent_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_r[None, :],
        mask=head_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + seq * stride_peb + heads[:, None] * stride_peh + offs_p[None, :],
        mask=head_ok[:, None] & p_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        token_ok = tokens < end
        # only pages of tokens below seq_len are looked up: later entries may be anything
        block = tl.load(table_row + tokens // PAGE_SIZE, mask=token_ok, other=0).to(tl.int64)
        rows = kv_ptr + block * stride_kv_block + (tokens % PAGE_SIZE) * stride_kv_token
        c = tl.load(rows[:, None] + offs_r[None, :], mask=token_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + RANK + offs_p[None, :], mask=token_ok[:, None] & p_ok[None, :], other=0.0)
        if FP32_DOT:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
            scores = tl.dot(q, tl.trans(c), input_precision="ieee")
            scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(c))
            scores = tl.dot(q_pe, tl.trans(k_pe), scores)
        scores = tl.where(token_ok[None, :], scores * scale_log2, float("-inf"))
        # every tile has a token below `end`, so m_new is finite and no -inf - -inf appears
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = tl.dot(p, c, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None])
        m = m_new

    has_keys = row_sum > 0.0
    row_sum = tl.where(has_keys, row_sum, 1.0)
    o = acc / row_sum[:, None]
    lse = tl.where(has_keys, (m + tl.log2(row_sum)) * 0.6931471805599453, float("-inf"))  # log2 -> ln
    out = o_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_r[None, :]
    tl.store(out, o, mask=head_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    o_ptr,
    lse_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = lse_part_ptr + seq * stride_plb + head * stride_plh
    lse_all = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    top = tl.max(lse_all, axis=0)
    # all splits empty: shift by 0 so the weights come out 0, not NaN
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse_all - top), axis=0)

    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    part_row = o_part_ptr + seq * stride_pb + head * stride_ph + offs_r
    for s in range(num_splits):
        weight = tl.exp(tl.load(lse_row + s) - top)
        # empty splits (weight 0) are not read at all
        part = tl.load(part_row + s * stride_ps, mask=offs_r < tl.where(weight > 0.0, RANK, 0), other=0.0)
        acc += weight * part

    has_keys = total > 0.0
    total_safe = tl.where(has_keys, total, 1.0)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_r, acc / total_safe, mask=r_ok)
    tl.store(lse_ptr + seq * stride_lb + head * stride_lh, tl.where(has_keys, top + tl.log(total_safe), float("-inf")))


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache; see naive.paged_mla_decode for the math.

    q_latent: [B, H, R], q_pe: [B, H, P] (bf16/fp16/fp32), kv_cache: [num_blocks, block_size, R + P]
    (last dim contiguous), block_tables: [B, max_blocks] int32/int64 (entries past a sequence's blocks
    are never read), seq_lens: [B] int32/int64. Returns (o_latent [B, H, R] float32, lse [B, H]
    float32, natural log); seq_len 0 gives o = 0, lse = -inf.

    max_seq_len: an upper bound on seq_lens used only to pick the split count; default
    max_blocks * block_size (no host sync). num_kv_splits: overrides that choice (fix it for CUDA
    graphs). config: tile sizes; None picks DEFAULT_CONFIG (bf16/fp16) or FP32_CONFIG.
    """
    check_decode_shapes(q_latent, q_pe, kv_cache, kv_lora_rank)
    batch, num_heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if q_pe.shape[:2] != (batch, num_heads) or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"batch/head shapes disagree: q_latent {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)}, "
            f"block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache needs a contiguous last dim, got strides {kv_cache.stride()}")
    page_size = kv_cache.shape[1]
    capacity = block_tables.shape[1] * page_size
    if max_seq_len is None:
        max_seq_len = capacity
    elif max_seq_len > capacity:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds what block_tables [.., {block_tables.shape[1]}] of "
            f"block_size {page_size} can address ({capacity})"
        )

    device = q_latent.device
    o_latent = torch.empty(batch, num_heads, rank, dtype=torch.float32, device=device)
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=device)
    if batch == 0 or num_heads == 0:
        return o_latent, lse
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()

    low_precision = q_latent.dtype == q_pe.dtype == kv_cache.dtype and kv_cache.dtype in (torch.bfloat16, torch.float16)
    cfg = config or (DEFAULT_CONFIG if low_precision else FP32_CONFIG)
    head_groups = triton.cdiv(num_heads, cfg.block_h)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(batch, head_groups, max_seq_len, _num_sms(device))
    elif num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    if num_kv_splits == 1:
        o_part, lse_part = o_latent.unsqueeze(2), lse.unsqueeze(2)
    else:
        o_part = torch.empty(batch, num_heads, num_kv_splits, rank, dtype=torch.float32, device=device)
        lse_part = torch.empty(batch, num_heads, num_kv_splits, dtype=torch.float32, device=device)

    block_r = max(16, triton.next_power_of_2(rank))
    _split_kernel[(head_groups, num_kv_splits, batch)](
        q_latent,
        q_pe,
        kv_cache,
        block_tables,
        seq_lens,
        o_part,
        lse_part,
        scale * _LOG2E,
        num_heads,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        RANK=rank,
        ROPE=rope,
        BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        PAGE_SIZE=page_size,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        FP32_DOT=not low_precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_kv_splits > 1:
        _merge_kernel[(batch, num_heads)](
            o_part,
            lse_part,
            o_latent,
            lse,
            num_kv_splits,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse_part.stride(0),
            lse_part.stride(1),
            o_latent.stride(0),
            o_latent.stride(1),
            lse.stride(0),
            lse.stride(1),
            RANK=rank,
            BLOCK_R=block_r,
            BLOCK_S=triton.next_power_of_2(num_kv_splits),
            num_warps=4,
        )
    return o_latent, lse
