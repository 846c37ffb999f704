"""DCPLayout against a layout built independently: deal each scheduler block's tokens to the ranks in
runs of `interleave`, round robin, each rank filling its own page from the front."""

from __future__ import annotations

import pytest
import torch

from deltaserve.distributed.dcp_layout import DCPLayout

PAD_SLOT = -1


def dealt(seq_len: int, block_ids: list[int], size: int, block_size: int, interleave: int) -> dict[int, tuple]:
    """position -> (rank, local slot), by dealing the tokens out."""
    where, fill = {}, {}
    for pos in range(seq_len):
        block, off = divmod(pos, block_size * size)
        rank = (off // interleave) % size
        local = fill.get((block, rank), 0)
        fill[(block, rank)] = local + 1
        where[pos] = (rank, block_ids[block] * block_size + local)
    return where


@pytest.mark.parametrize(("size", "block_size", "interleave"), [(1, 4, 1), (2, 4, 1), (2, 4, 4), (4, 8, 2), (3, 6, 3)])
@pytest.mark.parametrize("seq_len", [1, 5, 23, 96, 97])
def test_every_token_is_placed_once_where_the_deal_puts_it(size, block_size, interleave, seq_len):
    blocks = -(-seq_len // (block_size * size))
    block_ids = [7 * b + 3 for b in range(blocks)]  # not in order of the blocks, not contiguous
    want = dealt(seq_len, block_ids, size, block_size, interleave)
    positions = torch.arange(seq_len)
    token_blocks = torch.tensor(block_ids)[positions // (block_size * size)]
    placed: dict[int, tuple] = {}
    for rank in range(size):
        layout = DCPLayout(size, rank, block_size, interleave)
        slots = layout.slot_mapping(token_blocks, positions, PAD_SLOT)
        for pos, slot in enumerate(slots.tolist()):
            if slot != PAD_SLOT:
                assert pos not in placed, f"position {pos} placed twice"
                placed[pos] = (rank, slot)
        mine = [p for p, (r, _) in want.items() if r == rank]
        assert layout.local_seq_lens(torch.tensor([seq_len])).item() == len(mine)
        assert layout.local_positions_of_rank(seq_len, rank).tolist() == mine
        # the rank's tokens fill its pages with no hole: slot i of the sequence is its i-th token
        pages = [want[p][1] for p in mine]
        assert pages == [block_ids[i // block_size] * block_size + i % block_size for i in range(len(mine))]
    assert placed == want


def test_a_long_context_is_split_evenly():
    layout = [DCPLayout(4, r, 16, 1) for r in range(4)]
    lens = [lay.local_seq_lens(torch.tensor([1 << 20])).item() for lay in layout]
    assert lens == [1 << 18] * 4


def test_interleave_must_divide_the_block_size():
    with pytest.raises(ValueError, match="dcp_kv_cache_interleave_size=3 must be a positive divisor of block_size=16"):
        DCPLayout(2, 0, 16, 3)
    with pytest.raises(ValueError, match="DCP rank 2 of a group of 2"):
        DCPLayout(2, 2, 16, 1)


@pytest.mark.parametrize(("size", "interleave"), [(2, 1), (2, 4), (4, 2)])
def test_decode_over_each_stripe_merged_equals_decode_over_the_whole(size, interleave):
    """Each rank's paged decode over its own stripe (local pages, local lengths), merged by log-sum-exp
    in float32, equals one decode over the whole sequence."""
    from deltaserve.ops.mla import merge_partial_attentions, paged_mla_decode, write_latents

    gen = torch.Generator().manual_seed(size * 10 + interleave)
    block_size, rank_dim, rope, heads = 8, 16, 4, 3
    seq_lens = [1, 13, 40, 67]
    latents = [torch.randn(n, rank_dim + rope, generator=gen) for n in seq_lens]
    q_latent = torch.randn(len(seq_lens), heads, rank_dim, generator=gen)
    q_pe = torch.randn(len(seq_lens), heads, rope, generator=gen)
    lens = torch.tensor(seq_lens)
    # the whole: one rank, blocks of block_size
    whole = torch.zeros(64, block_size, rank_dim + rope)
    tables = torch.zeros(len(seq_lens), 16, dtype=torch.long)
    next_block = 0
    for i, (n, lat) in enumerate(zip(seq_lens, latents, strict=True)):
        blocks = -(-n // block_size)
        tables[i, :blocks] = torch.arange(next_block, next_block + blocks)
        next_block += blocks
        pos = torch.arange(n)
        write_latents(whole, tables[i, pos // block_size] * block_size + pos % block_size, lat)
    want_o, want_lse = paged_mla_decode(q_latent, q_pe, whole, tables, lens, 0.3, rank_dim)
    # the stripes: scheduler blocks of block_size * size, the same ids on every rank
    parts = []
    for rank in range(size):
        layout = DCPLayout(size, rank, block_size, interleave)
        cache = torch.zeros(65, block_size, rank_dim + rope)
        dcp_tables = torch.zeros(len(seq_lens), 16, dtype=torch.long)
        next_block = 0
        for i, (n, lat) in enumerate(zip(seq_lens, latents, strict=True)):
            blocks = -(-n // layout.scheduler_block_size)
            dcp_tables[i, :blocks] = torch.arange(next_block, next_block + blocks)
            next_block += blocks
            pos = torch.arange(n)
            token_blocks = dcp_tables[i, pos // layout.scheduler_block_size]
            write_latents(cache, layout.slot_mapping(token_blocks, pos, 64 * block_size), lat)
        parts.append(paged_mla_decode(q_latent, q_pe, cache, dcp_tables, layout.local_seq_lens(lens), 0.3, rank_dim))
    o, lse = merge_partial_attentions(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
