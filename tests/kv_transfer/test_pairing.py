"""Pairing a consumer rank with a producer's ranks, and the ops of one request, on plain tensors.

Producer caches hold random values; a consumer rank's caches start at zero; the request's ops are
applied with a host memcpy (what a transfer engine's READ does) and the consumer's caches must hold
exactly its share: its KDA heads (recurrent rows and the q, k, v conv channels of those heads) and
its DCP stripe of the latents, in its own pages. Pairings: equal TP, a TP1 producer feeding TP2 and
TP4 consumers, PP2 producers, DCP 2 and 4 at interleave 1 and 4, different block sizes on the two
sides. Refusals name both sides' sizes.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.kv_transfer.layout import RankLayout, TensorRows
from deltaserve.kv_transfer.pairing import latent_ops, latent_runs, pair_ranks, request_ops, state_ops

HEADS, HEAD_DIM, WINDOW, LATENT = 4, 3, 3, 5
LAYERS = {0: "kda", 1: "mla", 2: "kda", 3: "mla"}


class Rank:
    """A rank's caches as tensors and their RankLayout."""

    def __init__(self, pp: int, tp: int, tp_rank: int, layers: list[int], block_size: int, num_blocks: int,
                 dcp: int = 1, dcp_rank: int = 0, interleave: int = 1, pp_rank: int = 0, fill: bool = False):
        heads = HEADS // tp
        make = torch.randn if fill else torch.zeros
        self.mla = {i: make(num_blocks, block_size, LATENT) for i in layers if LAYERS[i] == "mla"}
        self.kda = {i: (make(4, 3 * heads * HEAD_DIM, WINDOW), make(4, heads, HEAD_DIM, HEAD_DIM))
                    for i in layers if LAYERS[i] == "kda"}
        mla = {i: TensorRows.of(t) for i, t in self.mla.items()}
        kda = {i: (TensorRows.of(c), TensorRows.of(r)) for i, (c, r) in self.kda.items()}
        self.layout = RankLayout(pp_rank, tp_rank, tp, block_size, "", mla, kda, heads, pp, dcp, dcp_rank, interleave)


def producer(pp: int, tp: int, block_size: int) -> list[Rank]:
    per_stage = len(LAYERS) // pp
    return [Rank(pp, tp, t, list(range(p * per_stage, (p + 1) * per_stage)), block_size, 8, pp_rank=p, fill=True)
            for p in range(pp) for t in range(tp)]


def apply(ops) -> None:
    for dst, src, nbytes in ops:
        ctypes.memmove(dst, src, nbytes)


@pytest.mark.parametrize("pp,ptp,pbs,dtp,dcp,dbs,interleave", [
    (1, 1, 4, 1, 1, 4, 1),  # equal
    (1, 1, 4, 2, 1, 4, 1),  # a TP1 producer feeds a TP2 decode: head split
    (2, 1, 4, 2, 2, 4, 1),  # PP2 -> TP2 x DCP2
    (2, 1, 8, 4, 2, 4, 2),  # PP2 -> TP4 x DCP2, interleave 2, different block sizes
    (1, 2, 4, 4, 4, 2, 1),  # TP2 -> TP4 x DCP4
    (2, 2, 6, 2, 1, 4, 1),  # equal TP, block sizes that do not divide each other
])
def test_each_consumer_rank_gets_its_heads_and_stripe(pp, ptp, pbs, dtp, dcp, dbs, interleave):
    num_tokens = 27
    remotes = producer(pp, ptp, pbs)
    remote_blocks = [7, 2, 5, 0, 3, 6, 1][: -(-num_tokens // pbs)]
    remote_slot = 2
    for tp_rank in range(dtp):
        local = Rank(1, dtp, tp_rank, list(LAYERS), dbs, 16, dcp, tp_rank % dcp, interleave)
        local_blocks = [9, 4, 11, 1, 14, 3, 8, 12, 0, 5, 13, 2, 6, 10]
        pairing = pair_ranks(local.layout, [r.layout for r in remotes])
        ops = request_ops(pairing, local_blocks, remote_blocks, pbs, 1, remote_slot, num_tokens)
        for rank_ops in ops.values():
            apply(rank_ops)
        ratio = dtp // ptp
        source = {(r.layout.pp_rank, r.layout.tp_rank): r for r in remotes}
        heads = HEADS // dtp
        first = (tp_rank % ratio) * heads
        for layer, (conv, rec) in local.kda.items():
            src_conv, src_rec = source[(layer // (len(LAYERS) // pp), tp_rank // ratio)].kda[layer]
            assert torch.equal(rec[1], src_rec[remote_slot, first:first + heads])
            want = src_conv[remote_slot].view(3, HEADS // ptp, HEAD_DIM, WINDOW)[:, first:first + heads]
            assert torch.equal(conv[1], want.reshape(-1, WINDOW))
            assert not conv[0].any() and not rec[0].any()  # other slots untouched
        stripe = DCPLayout(dcp, tp_rank % dcp, dbs, interleave)
        positions = torch.arange(num_tokens)
        owned = positions[stripe.owner(positions) == stripe.rank]
        for layer, cache in local.mla.items():
            src = source[(layer // (len(LAYERS) // pp), tp_rank // ratio)].mla[layer]
            want = torch.stack([src[remote_blocks[p // pbs], p % pbs] for p in owned.tolist()])
            block_of = positions[owned] // stripe.scheduler_block_size
            got = torch.stack([cache[local_blocks[int(b)], int(off)]
                               for b, off in zip(block_of, stripe.local_offset(owned), strict=True)])
            assert torch.equal(got, want)
            assert int((cache != 0).any(-1).sum()) == len(owned)  # nothing else written


def test_runs_merge_into_pages_without_dcp_and_one_per_token_at_interleave_1():
    local = Rank(1, 1, 0, [1], 4, 8).layout
    assert latent_runs(10, local, 4) == [(0, 0, 4), (4, 4, 4), (8, 8, 2)]
    striped = Rank(1, 2, 1, [1], 4, 8, dcp=2, dcp_rank=1).layout
    assert latent_runs(6, striped, 4) == [(1, 0, 1), (3, 1, 1), (5, 2, 1)]
    wide = Rank(1, 2, 0, [1], 4, 8, dcp=2, dcp_rank=0, interleave=2).layout
    assert latent_runs(9, wide, 4) == [(0, 0, 2), (4, 2, 2), (8, 4, 1)]


@pytest.mark.parametrize("dtp,per_layer", [(1, 2), (2, 4)])
def test_state_ops_merge_q_k_v_when_the_consumer_takes_the_whole_segment(dtp, per_layer):
    """One op for the conv window and one for the recurrent rows per KDA layer at equal TP (as the
    topology check counts them); under a head split, one per q, k and v block plus the state."""
    remotes = [r.layout for r in producer(1, 1, 4)]
    local = Rank(1, dtp, 0, list(LAYERS), 4, 16).layout
    ops = state_ops(pair_ranks(local, remotes), 1, 2)
    kda_layers = sum(kind == "kda" for kind in LAYERS.values())
    assert sum(len(o) for o in ops.values()) == kda_layers * per_layer


def test_latent_ops_of_token_ranges_add_up_to_the_whole():
    """Chunked transfer reads [0, a), [a, b), [b, n): the same bytes land as one read of [0, n)."""
    num_tokens, remote_blocks, local_blocks = 27, [7, 2, 5, 0, 3, 6, 1], [9, 4, 11, 1, 14, 3, 8]
    remotes = producer(1, 1, 4)
    whole, parts = Rank(1, 1, 0, list(LAYERS), 4, 16), Rank(1, 1, 0, list(LAYERS), 4, 16)
    for rank, cuts in ((whole, [0, num_tokens]), (parts, [0, 5, 13, num_tokens])):
        pairing = pair_ranks(rank.layout, [r.layout for r in remotes])
        for start, end in zip(cuts[:-1], cuts[1:], strict=True):
            for rank_ops in latent_ops(pairing, local_blocks, remote_blocks, 4, start, end).values():
                apply(rank_ops)
    for layer, cache in whole.mla.items():
        assert cache.any() and torch.equal(cache, parts.mla[layer])


def test_pairing_refusals_name_both_sides():
    remotes = [r.layout for r in producer(1, 2, 4)]
    with pytest.raises(ValueError, match="decode tensor_parallel_size=1 is not a multiple of prefill "
                                         "tensor_parallel_size=2.*prefill pipeline_parallel_size=1"):
        pair_ranks(Rank(1, 1, 0, list(LAYERS), 4, 8).layout, remotes)
    odd = Rank(1, 4, 3, list(LAYERS), 4, 8).layout  # 1 head each: fine
    assert pair_ranks(odd, remotes).head_offset == 1
    with pytest.raises(ValueError, match="no producer rank has tp_rank 1, the head group of decode tp_rank 3"):
        pair_ranks(odd, remotes[:1])  # the producer's second TP rank is missing
    wrong_heads = RankLayout(0, 1, 4, 4, "", odd.mla, odd.kda, 2)
    with pytest.raises(ValueError, match="do not lie inside prefill tp_rank 0's head group"):
        pair_ranks(wrong_heads, remotes)
    only_stage_0 = [r.layout for r in producer(2, 1, 4)][:1]
    with pytest.raises(ValueError, match=r"no cache for layers \[2, 3\]"):
        pair_ranks(Rank(1, 1, 0, list(LAYERS), 4, 8).layout, only_stage_0)
    pp_decode = Rank(2, 1, 0, [0, 1], 4, 8).layout
    with pytest.raises(ValueError, match="pipeline-parallel decode"):
        pair_ranks(pp_decode, [r.layout for r in producer(1, 1, 4)])
