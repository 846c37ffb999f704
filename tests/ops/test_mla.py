"""MLA ops: the paged latent cache, expanded prefill attention, absorbed paged decode and the merge."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.ops.mla import (
    attention_expanded,
    gather_latents,
    merge_attention_states,
    paged_mla_decode,
    write_latents,
)

R, P, BLOCK = 32, 8, 4  # kv_lora_rank, qk_rope_head_dim, block_size
NUM_BLOCKS = 24


def _poisoned_cache() -> torch.Tensor:
    cache = torch.full((NUM_BLOCKS, BLOCK, R + P), float("nan"))
    cache[1::2] = 1e30  # half NaN, half huge: either would show up if read
    return cache


def _fill_sequences(cache: torch.Tensor, seq_lens: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """Write random latents of each sequence into shuffled blocks; returns each sequence's block ids."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    tables, used = [], 0
    for length in seq_lens:
        nb = -(-length // BLOCK)
        blocks = perm[used : used + nb]
        used += nb
        positions = torch.arange(length)
        slots = blocks[positions // BLOCK] * BLOCK + positions % BLOCK
        write_latents(cache, slots, torch.randn(length, R + P, generator=gen))
        tables.append(blocks)
    return tables


def test_write_gather_round_trip_with_shuffled_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((NUM_BLOCKS, BLOCK, R + P), float("nan"))
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:4]
    length = 13
    positions = torch.arange(length)
    slots = blocks[positions // BLOCK] * BLOCK + positions % BLOCK
    values = torch.randn(length, R + P, generator=gen)
    order = torch.randperm(length, generator=gen)  # tokens arrive in any order
    write_latents(cache, slots[order], values[order])
    torch.testing.assert_close(gather_latents(cache, blocks, length), values, rtol=0, atol=0)
    torch.testing.assert_close(gather_latents(cache, blocks, 6), values[:6], rtol=0, atol=0)
    # nothing else was touched
    written = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    written[slots] = True
    assert cache.view(-1, R + P)[~written].isnan().all()
    with pytest.raises(ValueError, match="num_tokens=17"):
        gather_latents(cache, blocks, 17)


def _expanded_reference(q, k, v, scale: float, num_context: int) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = num_context + i + 1
        scores = torch.einsum("hd,lhd->hl", q[i], k[:visible]) * scale
        out[i] = torch.einsum("hl,lhv->hv", scores.softmax(-1), v[:visible])
    return out


@pytest.mark.parametrize(("n", "num_context"), [(1, 0), (7, 0), (5, 9), (1, 12)])
def test_attention_expanded_matches_float64(n: int, num_context: int) -> None:
    gen = torch.Generator().manual_seed(n * 31 + num_context)
    heads, dqk, dv = 3, 24, 16
    q = torch.randn(n, heads, dqk, generator=gen)
    k = torch.randn(num_context + n, heads, dqk, generator=gen)
    v = torch.randn(num_context + n, heads, dv, generator=gen)
    scale = dqk**-0.5
    got = attention_expanded(q, k, v, scale, num_context)
    assert got.dtype == q.dtype and got.shape == (n, heads, dv)
    torch.testing.assert_close(got.double(), _expanded_reference(q, k, v, scale, num_context), rtol=1e-5, atol=1e-5)


def _decode_reference(q_latent, q_pe, cache, tables: list[torch.Tensor], seq_lens: list[int], scale: float):
    o = torch.empty(q_latent.shape, dtype=torch.float64)
    lse = torch.empty(q_latent.shape[:2], dtype=torch.float64)
    for b, (blocks, length) in enumerate(zip(tables, seq_lens, strict=True)):
        entries = cache[blocks].reshape(-1, R + P)[:length].double()
        c, kpe = entries[:, :R], entries[:, R:]
        scores = scale * (q_latent[b].double() @ c.T + q_pe[b].double() @ kpe.T)
        lse[b] = torch.logsumexp(scores, dim=-1)
        o[b] = scores.softmax(-1) @ c
    return o, lse


def _padded_tables(tables: list[torch.Tensor], width: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables padded with a mix of 0 and random (poisoned) block ids."""
    padded = torch.randint(0, NUM_BLOCKS, (len(tables), width), generator=gen)
    padded[:, ::2] = 0
    for b, blocks in enumerate(tables):
        padded[b, : len(blocks)] = blocks
    return padded


def test_paged_decode_matches_float64_and_ignores_poison() -> None:
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, 5, 16, 23, 8]
    heads = 4
    cache = _poisoned_cache()
    tables = _fill_sequences(cache, seq_lens, gen)
    block_tables = _padded_tables(tables, width=8, gen=gen)
    q_latent = torch.randn(len(seq_lens), heads, R, generator=gen)
    q_pe = torch.randn(len(seq_lens), heads, P, generator=gen)
    scale = 24**-0.5
    o, lse = paged_mla_decode(q_latent, q_pe, cache, block_tables, torch.tensor(seq_lens), scale, R)
    assert o.dtype == lse.dtype == torch.float32
    assert o.shape == (len(seq_lens), heads, R) and lse.shape == (len(seq_lens), heads)
    assert o.isfinite().all() and lse.isfinite().all()
    o_ref, lse_ref = _decode_reference(q_latent, q_pe, cache, tables, seq_lens, scale)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_lens", [[11], [3, 17, 9]])
def test_absorbed_decode_equals_expanded_attention(seq_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    heads, dn, dv = 4, 16, 12
    kv_b_weight = torch.randn(heads * (dn + dv), R, generator=gen) / math.sqrt(R)
    cache = _poisoned_cache()
    tables = _fill_sequences(cache, seq_lens, gen)
    q = torch.randn(len(seq_lens), heads, dn + P, generator=gen)
    scale = (dn + P) ** -0.5

    expanded = []
    for b, length in enumerate(seq_lens):
        c, kpe = gather_latents(cache, tables[b], length).split([R, P], dim=-1)
        k_nope, v = (c @ kv_b_weight.T).view(length, heads, dn + dv).split([dn, dv], dim=-1)
        k = torch.cat([k_nope, kpe.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
        expanded.append(attention_expanded(q[b : b + 1], k, v, scale, length - 1))
    expanded = torch.cat(expanded)

    w = kv_b_weight.view(heads, dn + dv, R)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_nope, q_pe = q.split([dn, P], dim=-1)
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    block_tables = _padded_tables(tables, width=6, gen=gen)
    o_latent, _ = paged_mla_decode(q_latent, q_pe, cache, block_tables, torch.tensor(seq_lens), scale, R)
    absorbed = torch.einsum("bhr,hvr->bhv", o_latent, w_uv)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


def test_merge_of_two_halves_equals_whole() -> None:
    gen = torch.Generator().manual_seed(9)
    seq_lens = [20, 13]
    split_blocks = [2, 3]  # the first part is whole blocks, so the second starts at a block boundary
    heads = 2
    cache = _poisoned_cache()
    tables = _fill_sequences(cache, seq_lens, gen)
    q_latent = torch.randn(2, heads, R, generator=gen)
    q_pe = torch.randn(2, heads, P, generator=gen)
    scale = 0.2
    lens = torch.tensor(seq_lens)
    o_whole, lse_whole = paged_mla_decode(q_latent, q_pe, cache, _padded_tables(tables, 6, gen), lens, scale, R)

    first = torch.tensor([n * BLOCK for n in split_blocks])
    head_tables = _padded_tables([t[:n] for t, n in zip(tables, split_blocks, strict=True)], 6, gen)
    tail_tables = _padded_tables([t[n:] for t, n in zip(tables, split_blocks, strict=True)], 6, gen)
    o_a, lse_a = paged_mla_decode(q_latent, q_pe, cache, head_tables, first, scale, R)
    o_b, lse_b = paged_mla_decode(q_latent, q_pe, cache, tail_tables, lens - first, scale, R)
    o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o, o_whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_whole, rtol=1e-5, atol=1e-5)
    # the merge is symmetric and an empty part (lse = -inf) leaves the other unchanged
    o_swapped, _ = merge_attention_states(o_b, lse_b, o_a, lse_a)
    torch.testing.assert_close(o_swapped, o_whole, rtol=1e-5, atol=1e-5)
    empty_lse = torch.full_like(lse_a, float("-inf"))
    o_same, lse_same = merge_attention_states(o_a, lse_a, torch.zeros_like(o_a), empty_lse)
    torch.testing.assert_close(o_same, o_a, rtol=0, atol=0)
    torch.testing.assert_close(lse_same, lse_a, rtol=0, atol=0)
    o_none, lse_none = merge_attention_states(torch.zeros_like(o_a), empty_lse, torch.zeros_like(o_a), empty_lse)
    assert (o_none == 0).all() and torch.isneginf(lse_none).all()
