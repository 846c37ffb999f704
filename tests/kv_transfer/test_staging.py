"""MLA staging for DCP consumers, on plain tensors: the staged path lands the same bytes as the
per-token path, with one op per destination page per MLA layer; slots are handed out, refused when
all are held, and taken back after their timeout; the reserve is what the slots take.

The producer's StagingPool gathers chunks of a consumer rank's stripe into its slots; the consumer's
ops (`staged_ops`) are applied with a host memcpy, as a transfer engine's READ would.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.kv_transfer.pairing import pair_ranks, request_ops, staged_ops
from deltaserve.kv_transfer.staging import StagingPool, staging_reserve_bytes, stripe_positions

from .test_pairing import LATENT, LAYERS, Rank, apply, producer


def test_stripe_positions():
    assert stripe_positions(0, 4, 2, 1, 1) == [1, 3, 5, 7]
    assert stripe_positions(2, 4, 2, 0, 4) == [2, 3, 8, 9]
    assert stripe_positions(0, 3, 4, 3, 2) == [6, 7, 14]


def _with_staging(rank: Rank, pool: StagingPool) -> None:
    rank.layout = dataclasses.replace(rank.layout, staging=pool.rows(), staging_capacity=pool.capacity)


@pytest.mark.parametrize("chunk_pages", [1, 4])
@pytest.mark.parametrize("dtp,dcp,dbs,interleave", [(2, 2, 4, 1), (4, 4, 2, 1), (2, 2, 4, 2)])
def test_staged_reads_land_the_bytes_of_the_per_token_path(chunk_pages, dtp, dcp, dbs, interleave):
    num_tokens, pbs = 31, 4
    remotes = producer(2, 1, pbs)  # PP2 x TP1 (8 blocks a rank): one MLA layer per stage
    remote_blocks = [7, 2, 5, 0, 3, 6, 1, 4]
    pools = {}
    for r in remotes:
        if r.mla:
            pools[(r.layout.pp_rank, r.layout.tp_rank)] = pool = StagingPool(r.mla, chunk_pages, 2, pbs)
            _with_staging(r, pool)
    for tp_rank in range(dtp):
        plain = Rank(1, dtp, tp_rank, list(LAYERS), dbs, 40, dcp, tp_rank % dcp, interleave)
        staged = Rank(1, dtp, tp_rank, list(LAYERS), dbs, 40, dcp, tp_rank % dcp, interleave)
        local_blocks = list(range(40))[::-1]
        pairing = pair_ranks(plain.layout, [r.layout for r in remotes])
        per_token = request_ops(pairing, local_blocks, remote_blocks, pbs, 1, 2, num_tokens)
        for ops in per_token.values():
            apply(ops)
        pairing = pair_ranks(staged.layout, [r.layout for r in remotes])
        keys = frozenset(pairing.mla_source.values())
        rest = request_ops(pairing, local_blocks, remote_blocks, pbs, 1, 2, num_tokens, keys)
        for ops in rest.values():
            apply(ops)
        length = int(DCPLayout(dcp, tp_rank % dcp, dbs, interleave).local_seq_lens(torch.tensor([num_tokens]))[0])
        staged_count = 0
        for key in keys:
            pool = pools[key]
            for start in range(0, length, pool.capacity):
                count = min(pool.capacity, length - start)
                slot = pool.stage(remote_blocks, num_tokens, start, count, dcp, tp_rank % dcp, interleave, 10.0)
                ops = staged_ops(pairing, key, local_blocks, slot, start, count)
                staged_count += len(ops)
                apply(ops)
                pool.unstage(slot)
            assert pool.num_free == pool.num_slots
        for layer in plain.mla:
            assert torch.equal(staged.mla[layer], plain.mla[layer])
            assert staged.mla[layer].abs().sum() > 0
        # one op per destination page touched per chunk per layer, against one per token at interleave 1
        mla_per_token = sum(len(ops) for key, ops in per_token.items()) - sum(len(o) for o in rest.values())
        pages = -(-length // dbs)
        assert pages * len(plain.mla) <= staged_count <= (pages + -(-length // pools[next(iter(keys))].capacity)) \
            * len(plain.mla)
        if interleave == 1:
            assert mla_per_token == length * len(plain.mla)


def test_slots_run_out_and_come_back():
    cache = {1: torch.randn(4, 4, LATENT)}
    pool = StagingPool(cache, 1, 2, 4)
    assert pool.capacity == 4
    a = pool.stage([0, 1], 8, 0, 4, 2, 0, 1, hold_s=0.05)
    b = pool.stage([0, 1], 8, 0, 4, 2, 1, 1, hold_s=10.0)
    assert {a, b} == {0, 1} and pool.stage([0, 1], 8, 0, 4, 2, 0, 1, hold_s=10.0) is None
    assert torch.equal(pool.slots[1][b], cache[1].view(-1, LATENT)[[1, 3, 5, 7]])
    time.sleep(0.06)
    assert pool.stage([0, 1], 8, 0, 4, 2, 0, 1, hold_s=10.0) == a  # taken back after its hold
    pool.unstage(b)
    assert pool.num_free == 1
    with pytest.raises(ValueError, match="past the request's 8 tokens"):
        pool.stage([0, 1], 8, 2, 4, 2, 1, 1, hold_s=1.0)
    with pytest.raises(ValueError, match="does not fit a slot of 4"):
        pool.stage([0, 1], 8, 0, 5, 2, 0, 1, hold_s=1.0)


def test_the_slots_fit_their_reserve():
    caches = {1: torch.zeros(8, 16, 576, dtype=torch.bfloat16), 5: torch.zeros(8, 16, 576, dtype=torch.bfloat16)}
    pool = StagingPool(caches, 4, 3, 16)
    held = sum(t.numel() * t.element_size() for t in pool.slots.values())
    assert held == staging_reserve_bytes(4, 3, 16, 576, 2, 2)
