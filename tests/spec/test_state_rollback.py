"""Verify steps keep the state after every position: after accepting j drafts, the slot of position j
holds bit for bit (float32) the state and conv window plain decoding of those j + 1 tokens leaves, and
the next verify step starts from it (the conv's output too, before its SiLU; after it, to two ulps); on a
GPU, fla's spec-decoding kernel agrees with the reference."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.conv.naive import causal_conv1d_decode
from deltaserve.ops.kda.naive import l2norm, recurrent_kda_step
from deltaserve.spec.state_rollback import causal_conv1d_verify, recurrent_kda_verify

N, T, H, K, V, D, W = 3, 4, 2, 8, 8, 12, 4


def inputs(seed: int, n: int = N, t: int = T, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, t, H, K, generator=gen)
    k = l2norm(torch.randn(n, t, H, K, generator=gen))
    v = torch.randn(n, t, H, V, generator=gen)
    g = -torch.rand(n, t, H, K, generator=gen)
    beta = torch.rand(n, t, H, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta)]


def test_each_position_slot_holds_plain_decodings_state_bit_for_bit():
    q, k, v, g, beta = inputs(0)
    pool = torch.randn(16, H, K, V, generator=torch.Generator().manual_seed(1))
    start = pool[[0, 1, 2]].clone()  # each request's state before the step, in its slot 0, 1, 2
    indices = torch.tensor([[0, 3, 4, 5], [1, 6, 7, 8], [2, 9, 10, 11]])
    o = recurrent_kda_verify(q, k, v, g, beta, K ** -0.5, pool, indices, torch.ones(N, dtype=torch.long))
    for n in range(N):
        state = start[n : n + 1]
        for t in range(T):  # plain decoding, one token at a time
            out, state = recurrent_kda_step(q[n : n + 1, t], k[n : n + 1, t], v[n : n + 1, t], g[n : n + 1, t],
                                            beta[n : n + 1, t], K ** -0.5, state)
            assert torch.equal(pool[indices[n, t]], state[0]) and torch.equal(o[n, t], out[0])


def test_the_next_step_starts_from_the_last_accepted_position():
    q, k, v, g, beta = inputs(2)
    pool = torch.randn(16, H, K, V, generator=torch.Generator().manual_seed(3))
    indices = torch.tensor([[0, 3, 4, 5], [1, 6, 7, 8], [2, 9, 10, 11]])
    recurrent_kda_verify(q, k, v, g, beta, 0.3, pool, indices, torch.ones(N, dtype=torch.long))
    accepted = torch.tensor([1, 3, 4])  # request 0 kept only its first token, request 2 everything
    chosen = pool[indices[torch.arange(N), accepted - 1]].clone()
    q2, k2, v2, g2, beta2 = inputs(4)
    o = recurrent_kda_verify(q2, k2, v2, g2, beta2, 0.3, pool, indices, accepted)
    out, _ = recurrent_kda_step(q2[:, 0], k2[:, 0], v2[:, 0], g2[:, 0], beta2[:, 0], 0.3, chosen)
    assert torch.equal(o[:, 0], out)


# SiLU on CPU runs a vectorized exp over whole vector lanes and a scalar one over the rest, so the same
# input can round one float32 ulp apart in tensors of other shapes (seen on an AMD EPYC with AVX2): the
# convolution itself is checked bit for bit without the activation, and with it to two ulps.
SILU_ULPS = {"rtol": 2.4e-7, "atol": 1e-12}


def assert_same_conv_output(got: torch.Tensor, want: torch.Tensor, activation: str | None) -> None:
    if activation is None:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **SILU_ULPS)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_windows_per_position_equal_plain_decoding(activation):
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(N, T, D, generator=gen), torch.randn(D, W, generator=gen)
    pool = torch.randn(16, D, W - 1, generator=gen)
    plain_pool = pool.clone()
    indices = torch.tensor([[0, 3, 4, 5], [1, 6, 7, 8], [2, 9, 10, 11]])
    accepted = torch.tensor([1, 1, 1])
    y = causal_conv1d_verify(x, weight, pool, indices, accepted, activation)
    slots = torch.tensor([0, 1, 2])
    for t in range(T):
        want = causal_conv1d_decode(x[:, t], weight, plain_pool, slots, activation)
        assert_same_conv_output(y[:, t], want, activation)
        assert torch.equal(pool[indices[:, t]], plain_pool[slots])  # the windows: copies, always bit for bit
    # a second step from position 2 of request 1 reads the window the first step left there
    before = pool[indices[1, 2]].clone()
    x2 = torch.randn(N, T, D, generator=gen)
    y2 = causal_conv1d_verify(x2, weight, pool, indices, torch.tensor([1, 3, 2]), activation)
    scratch = before.unsqueeze(0).clone()
    want = causal_conv1d_decode(x2[1:2, 0], weight, scratch, torch.tensor([0]), activation)
    assert_same_conv_output(y2[1, 0], want[0], activation)


def test_bad_indices_are_refused():
    q, k, v, g, beta = inputs(6)
    pool = torch.zeros(16, H, K, V)
    with pytest.raises(ValueError, match="expected \\[3, 4\\]"):
        recurrent_kda_verify(q, k, v, g, beta, 0.3, pool, torch.zeros(3, 3, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="num_accepted must lie in"):
        recurrent_kda_verify(q, k, v, g, beta, 0.3, pool, torch.arange(12).view(3, 4), torch.tensor([1, 5, 1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_spec_decoding_kernel_agrees_with_the_reference_on_cuda():
    fused = pytest.importorskip("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd
    q, k, v, g, beta = inputs(7, device="cuda")
    pool = torch.randn(16, H, K, V, generator=torch.Generator().manual_seed(8)).cuda()
    ref_pool = pool.clone()
    indices = torch.tensor([[0, 3, 4, 5], [1, 6, 7, 8], [2, 9, 10, 11]], device="cuda")
    accepted = torch.tensor([1, 2, 4], device="cuda")
    ref = recurrent_kda_verify(q, k, v, g, beta, K ** -0.5, ref_pool, indices, accepted)
    cu_seqlens = torch.arange(0, (N + 1) * T, T, device="cuda", dtype=torch.long)
    flat = [x.reshape(1, N * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    o, _ = fused(*flat, initial_state=pool, scale=K ** -0.5, inplace_final_state=True, cu_seqlens=cu_seqlens,
                 ssm_state_indices=indices, num_accepted_tokens=accepted)
    torch.testing.assert_close(o.view(N, T, H, V), ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(pool[indices.flatten()], ref_pool[indices.flatten()], atol=2e-4, rtol=2e-4)


def _layer_and_pools(seed: int = 4):
    from hf_reference import tiny_hub_config

    from deltaserve.config.model_config import KimiLinearConfig
    from deltaserve.config.parallel import ParallelConfig
    from deltaserve.model.layers.kda import KimiDeltaAttention

    torch.manual_seed(seed)
    config = KimiLinearConfig.from_dict(tiny_hub_config())
    layer = KimiDeltaAttention(config, ParallelConfig(), torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    conv = torch.randn(8, 3 * layer.local_dim, layer.conv_width - 1)
    rec = torch.randn(8, layer.num_heads, layer.head_dim, layer.head_dim)
    return config, layer, conv, rec


def _context(num_decodes: int, slots: list[int], verify: list[int] | None = None):
    from deltaserve.model.forward_context import ForwardContext

    long = torch.long
    n = len(verify) if verify else num_decodes
    extra = {}
    if verify:
        extra = {"num_verify_tokens": len(verify), "verify_seq_lens": (len(verify),),
                 "verify_cu_seqlens": torch.tensor([0, len(verify)]), "verify_state_indices": torch.tensor([verify])}
    return ForwardContext(
        num_tokens=n, num_decodes=num_decodes, slot_mapping=torch.zeros(n, dtype=long),
        decode_state_slots=torch.tensor(slots, dtype=long), decode_block_tables=torch.zeros(num_decodes, 1, dtype=long),
        decode_seq_lens=torch.ones(num_decodes, dtype=long), prefill_cu_seqlens=torch.zeros(1, dtype=long),
        prefill_state_slots=torch.zeros(0, dtype=long), prefill_has_initial_state=torch.zeros(0, dtype=torch.bool),
        prefill_sequences=(), **extra)


@pytest.mark.parametrize("accepted", [1, 2, 4])
def test_a_kda_layer_rolled_back_after_a_verify_window_holds_plain_decodings_state(accepted, monkeypatch):
    """The whole layer (projections, conv, gates, KDA): a window of 4 tokens that accepted `accepted`
    positions leaves in that position's slot the conv window and recurrent state of decoding those tokens
    one at a time. Not bit for bit: the projections of 4 rows round differently from those of 1 row on
    the CPU (about 2e-6, as any change of batch size does); the KDA and conv arithmetic itself is bit for
    bit the same on the same inputs (the test above)."""
    from deltaserve.model.forward_context import set_forward_context

    monkeypatch.setenv("DELTASERVE_KDA_BACKEND", "torch")
    config, layer, conv, rec = _layer_and_pools()
    x = torch.randn(4, config.hidden_size, generator=torch.Generator().manual_seed(9))
    plain_conv, plain_rec = conv.clone(), rec.clone()
    layer.bind_state(plain_conv, plain_rec)
    for t in range(accepted):
        with set_forward_context(_context(1, [0])):
            layer(x[t : t + 1])
    layer.bind_state(conv, rec)
    slots = [0, 5, 6, 7]
    with set_forward_context(_context(0, [], verify=slots)):
        layer(x)
    live = slots[accepted - 1]
    torch.testing.assert_close(conv[live], plain_conv[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(rec[live], plain_rec[0], rtol=0, atol=2e-5)
