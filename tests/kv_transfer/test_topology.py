"""The prefill -> decode topology check: placement, costs and refusals, on CPU with exact numbers."""

from __future__ import annotations

import itertools

import pytest
import torch

from deltaserve.cli import main
from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.kv_transfer.topology import (
    EngineTopology,
    StageRead,
    TokenStripe,
    TransferSettings,
    parse_topology,
    per_token_descriptors,
    plan_topology,
)
from deltaserve.model_files.random_model import random_model_config

TINY = random_model_config("random:tiny")  # [KDA, KDA, MLA, KDA], 4 heads x 16
K48B = random_model_config("random:kimi-linear-48b-a3b")


def test_pp2_tp1_to_tp2_reads_layers_by_model_id_and_half_the_heads():
    plan = plan_topology(TINY, parse_topology("pp=2,tp=1"), parse_topology("tp=2"))
    assert plan.ok and [r.tp_rank for r in plan.reads] == [0, 1]
    assert [(s.layer_range, s.kda_layer_ids, s.mla_layer_ids) for s in plan.stages] == [
        ((0, 2), (0, 1), ()), ((2, 4), (3,), (2,))]
    for r in plan.reads:
        # stage 1's MLA layer is model layer 2 (its first layer), its KDA layer model layer 3
        assert r.reads == (StageRead(0, 0, (0, 1), ()), StageRead(1, 0, (3,), (2,)))
        assert r.producer_tp_rank == 0 and r.dcp_rank == 0 and r.dcp_group == r.tp_rank
    r0, r1 = plan.reads
    assert (r0.kda_heads, r0.segment_heads) == ((0, 2), (0, 2))
    assert (r1.kda_heads, r1.segment_heads) == ((2, 4), (2, 4))
    # conv channels [q | k | v], 64 channels each (4 heads x 16), 32 per decode rank
    assert r0.conv_channels == r0.segment_conv_channels == ((0, 32), (64, 96), (128, 160))
    assert r1.conv_channels == r1.segment_conv_channels == ((32, 64), (96, 128), (160, 192))
    # no DCP: every rank needs every token's latents
    assert r0.num_tokens == r1.num_tokens == plan.settings.prompt_tokens
    # 3 KDA layers: the recurrent rows plus one conv run for each of q, k, v (half a segment)
    assert r0.state_descriptors == 3 * 4


def test_tp2_to_tp4_reads_each_rank_from_the_segment_that_holds_its_heads():
    plan = plan_topology(TINY, EngineTopology(tp=2), EngineTopology(tp=4))
    assert plan.ok
    assert [r.producer_tp_rank for r in plan.reads] == [0, 0, 1, 1]
    r3 = plan.reads[3]
    assert (r3.kda_heads, r3.segment_heads) == ((3, 4), (1, 2))
    assert r3.conv_channels == ((48, 64), (112, 128), (176, 192))
    assert r3.segment_conv_channels == ((16, 32), (48, 64), (80, 96))  # a segment is 3 x 32 channels
    assert all(x.tp_rank == 1 for x in r3.reads)
    # the whole segment taken: conv state is one run per layer
    same = plan_topology(TINY, EngineTopology(tp=2), EngineTopology(tp=2))
    assert same.reads[1].state_descriptors == 3 * 2


def test_pp2_to_tp2_dcp2_stripes_every_token_to_one_rank():
    settings = TransferSettings(prompt_tokens=100, decode_block_size=4)
    plan = plan_topology(TINY, parse_topology("pp=2"), parse_topology("tp=2,dcp=2"), settings)
    assert plan.ok
    stripes = [r.stripe.positions(100) for r in plan.reads]
    assert stripes[0] == list(range(0, 100, 2)) and stripes[1] == list(range(1, 100, 2))
    assert sorted(stripes[0] + stripes[1]) == list(range(100))
    assert [r.num_tokens for r in plan.reads] == [50, 50]
    assert plan.cost is not None and plan.cost.latent_bytes == 100 * TINY.latent_dim * 2


@pytest.mark.parametrize("interleave", [1, 2, 4])
def test_every_dcp_group_reads_every_token_once(interleave):
    n = 203
    settings = TransferSettings(prompt_tokens=n, decode_block_size=8, dcp_interleave=interleave)
    plan = plan_topology(TINY, EngineTopology(tp=1, pp=2), EngineTopology(tp=4, dcp=2), settings)
    assert plan.ok
    for group in (0, 1):
        ranks = [r for r in plan.reads if r.dcp_group == group]
        assert [r.tp_rank for r in ranks] == [2 * group, 2 * group + 1]
        got = sorted(p for r in ranks for p in r.stripe.positions(n))
        assert got == list(range(n))
    for r in plan.reads:  # the engine's own layout agrees on owner, local slot and local length
        layout = DCPLayout(size=2, rank=r.dcp_rank, block_size=8, interleave=interleave)
        positions = torch.arange(n)
        owned = layout.owner(positions) == r.dcp_rank
        assert r.stripe.positions(n) == positions[owned].tolist()
        assert [r.stripe.local_offset(p) for p in r.stripe.positions(n)] == list(range(r.num_tokens))
        assert r.num_tokens == int(layout.local_seq_lens(torch.tensor([n]))[0])


def _brute_force_runs(n: int, dcp: int, rank: int, interleave: int, block: int, decode_block: int) -> int:
    """Runs of a rank's tokens that stay adjacent, on one producer page and one destination page."""
    layout = DCPLayout(size=dcp, rank=rank, block_size=decode_block, interleave=interleave)
    positions = layout.local_positions_of_rank(n, rank).tolist()
    local = list(range(len(positions)))  # a rank's tokens fill its pages in order
    runs = 0
    for i, p in enumerate(positions):
        same = (i > 0 and positions[i - 1] == p - 1 and (p - 1) // block == p // block
                and local[i - 1] // decode_block == local[i] // decode_block)
        runs += not same
    return runs


def test_per_token_descriptors_match_a_token_by_token_count():
    grid = itertools.product([1, 2, 4], [1, 2, 4], [4, 6, 16], [4, 8, 16], [0, 1, 37, 130])
    for dcp, interleave, block, decode_block, n in grid:
        if decode_block % interleave:
            continue
        for rank in range(dcp):
            stripe = TokenStripe(dcp, rank, interleave)
            want = _brute_force_runs(n, dcp, rank, interleave, block, decode_block)
            assert per_token_descriptors(n, stripe, block, decode_block) == want, (dcp, interleave, block,
                                                                                 decode_block, n, rank)


def test_48b_pp8_to_tp8_dcp8_bytes_and_descriptors():
    n = 117_000
    prefill, decode = EngineTopology(tp=1, pp=8), EngineTopology(tp=8, dcp=8)
    plain = plan_topology(K48B, prefill, decode, TransferSettings(prompt_tokens=n))
    staged = plan_topology(K48B, prefill, decode, TransferSettings(prompt_tokens=n, staging_chunk_pages=128))
    assert plain.ok and staged.ok and plain.cost is not None and staged.cost is not None
    mla_layers, kda_layers = 7, 20
    latent_per_token = mla_layers * (512 + 64) * 2  # bf16: 8,064 B, "about 8 KB"
    recurrent = 32 * 128 * 128 * 4  # fp32 [H, K, V]
    conv = 3 * 32 * 128 * (4 - 1) * 2  # q, k, v channels x window 3, bf16
    assert plain.cost.latent_bytes_per_token == latent_per_token == 8064
    assert plain.cost.state_bytes == kda_layers * (recurrent + conv) == 43_417_600  # "about 43 MB"
    assert plain.cost.latent_bytes == n * latent_per_token  # one DCP group reads each token once
    per_rank = n // 8  # 14,625: 117,000 is a multiple of 8
    assert all(r.num_tokens == per_rank for r in plain.reads)
    assert all(r.state_bytes == kda_layers * (recurrent + conv) // 8 for r in plain.reads)
    # interleave 1: one descriptor per token per MLA layer on each of the 8 ranks, "about 1M"
    assert plain.cost.per_token_descriptors == 8 * per_rank * mla_layers == 819_000
    # staged: one per destination page of 16 tokens per MLA layer
    assert plain.cost.staged_descriptors == 8 * -(-per_rank // 16) * mla_layers == 51_240
    assert staged.cost.per_token_descriptors == 819_000 and staged.cost.staged_descriptors == 51_240
    assert plain.cost.staging_reserve_bytes == 0
    # 16 slots x 128 pages x 16 tokens x 1 MLA layer (the most any stage holds) x 576 x 2 B
    assert staged.cost.staging_reserve_bytes == 16 * 128 * 16 * 1 * 576 * 2 == 37_748_736
    assert [s.mla_layer_ids for s in staged.stages] == [(3,), (7,), (11,), (), (15,), (19,), (23,), (26,)]
    assert staged.stages[3].staging_reserve_bytes == 0
    # every stage holds KDA layers, placed by model layer id
    assert [s.layer_range for s in staged.stages][3:5] == [(12, 15), (15, 18)]
    assert staged.stages[4].kda_layer_ids == (16, 17)


@pytest.mark.parametrize("prefill,decode,settings,kind,names", [
    ("tp=4", "tp=2", {}, "tp_ratio", ["decode tp=2", "prefill tp=4"]),
    ("tp=2", "tp=6", {}, "head_group", ["num_heads=32", "prefill tp=2", "decode tp=6"]),
    ("pp=2", "tp=2,pp=2", {}, "pp_decode", ["a PP decode consumer is not supported", "decode pp=2"]),
    ("tp=1", "tp=4,dcp=3", {}, "dcp_divides_tp", ["dcp=3", "decode tp=4"]),
    ("tp=1", "tp=2,dcp=2", {"dcp_interleave": 3}, "interleave", ["interleave=3", "decode block size=16"]),
    ("pp=8", "tp=8,dcp=8", {"chunked_transfer": True}, "chunked_to_dcp", ["decode dcp=8", "prefill pp=8",
                                                                          "HTTP 400"]),
])
def test_each_refusal_names_both_sides(prefill, decode, settings, kind, names):
    plan = plan_topology(K48B, parse_topology(prefill), parse_topology(decode), TransferSettings(**settings))
    assert [r.kind for r in plan.refusals] == [kind]
    assert all(name in plan.refusals[0].reason for name in names), plan.refusals[0].reason
    assert plan.reads == () and plan.cost is None
    with pytest.raises(ValueError, match="is refused") as refused:
        plan.raise_if_refused()
    assert plan.refusals[0].reason in str(refused.value)


def test_a_stage_without_a_kda_layer_is_refused_by_name():
    plan = plan_topology(TINY, EngineTopology(pp=4), EngineTopology(tp=2))
    assert [r.kind for r in plan.refusals] == ["stage_without_kda"]
    assert "pp_rank=2" in plan.refusals[0].reason and "[2, 3)" in plan.refusals[0].reason
    empty = plan_topology(TINY, EngineTopology(pp=5), EngineTopology(tp=1))  # stage 4 has no layer
    assert [r.reason for r in empty.refusals if "pp_rank=4" in r.reason]


def test_parse_topology_rejects_unknown_keys():
    assert parse_topology("pp=8,tp=1") == EngineTopology(tp=1, pp=8)
    for bad in ("ep=2", "tp=two", "tp=2,tp=4", "tp=0"):
        with pytest.raises(ValueError):
            parse_topology(bad)


def test_cli_prints_reads_costs_and_refusals(capsys):
    args = ["topology", "--prefill", "pp=8,tp=1", "--decode", "tp=8,dcp=8", "--model", "random:kimi-linear-48b-a3b",
            "--prompt-tokens", "117000", "--staging-chunk-pages", "128"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decode tp_rank 7 (dcp_rank 7 of DCP group 0) reads prefill tp_rank 0" in out
    assert "from (pp_rank 4, tp_rank 0): KDA layers 16 17; MLA layers 15" in out
    assert "KDA heads [28, 32) of 32" in out
    assert "latent tokens: p with (p // 1) % 8 == 3: 3, 11, 19, 27, ... (14,625 of 117,000)" in out
    assert "8,064 B per token" in out and "43,417,600 B per request" in out
    assert "819,000 on the per-token path" in out and "51,240 staged" in out
    assert "staging reserve: 37,748,736 B per producer GPU" in out
    assert out.rstrip().endswith("refusals: none")

    assert main(["topology", "--prefill", "tp=4", "--decode", "tp=2,pp=2"]) == 1
    out = capsys.readouterr().out
    assert "[tp_ratio] decode tp=2 is not a multiple of prefill tp=4" in out
    assert "[pp_decode] a PP decode consumer is not supported" in out
