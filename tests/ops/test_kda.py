"""KDA: the chunked form and the varlen/decode entry points against the token-by-token recurrence."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.kda import (
    KDAGate,
    chunk_kda_torch,
    kda_decode,
    kda_gate,
    kda_prefill,
    l2norm,
    naive_recurrent_kda,
)


def random_inputs(T, H=2, K=16, V=32, gen=None):
    q = l2norm(torch.randn(T, H, K, generator=gen))
    k = l2norm(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, H, V, generator=gen)
    g = -torch.rand(T, H, K, generator=gen) * 2.0  # log decay in [-2, 0]
    beta = torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


def test_l2norm_matches_formula():
    x = torch.randn(5, 3, 8)
    ref = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2norm(x), ref)


@pytest.mark.parametrize("T", [1, 7, 31, 32, 33, 100])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrence(T, with_state):
    q, k, v, g, beta = random_inputs(T)
    state = torch.randn(2, 16, 32) if with_state else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, 0.25, state)
    o, s = chunk_kda_torch(q, k, v, g, beta, 0.25, state, chunk_size=16)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_strong_decay_stays_finite():
    q, k, v, g, beta = random_inputs(64)
    g = g * 10  # down to -20 per step: exp of positive differences would overflow if not masked
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, 0.25)
    o, s = chunk_kda_torch(q, k, v, g, beta, 0.25)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)


def test_varlen_prefill_with_slots_poison_and_initial_states():
    lens = [5, 40, 1, 17]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    q, k, v, g, beta = random_inputs(sum(lens))
    pool = torch.randn(8, 2, 16, 32)
    pool[3] = float("nan")  # has_initial_state False: must not be read
    pool[6] = 1e30
    slots = torch.tensor([3, 1, 6, 4])
    has_initial = torch.tensor([False, True, False, True])
    untouched = pool[[0, 2, 5, 7]].clone()
    initial = {1: pool[1].clone(), 4: pool[4].clone()}
    o = kda_prefill(q, k, v, g, beta, 0.25, cu, pool, slots, has_initial)
    for i, slot in enumerate(slots.tolist()):
        s, e = cu[i].item(), cu[i + 1].item()
        o_ref, s_ref = naive_recurrent_kda(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], 0.25, initial.get(slot))
        torch.testing.assert_close(o[s:e], o_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pool[slot], s_ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(pool[[0, 2, 5, 7]], untouched)


def test_two_chunks_then_decodes_equal_one_pass():
    T = 50
    q, k, v, g, beta = random_inputs(T)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, 0.25)
    pool = torch.full((3, 2, 16, 32), float("nan"))
    slot = torch.tensor([2])
    out = []
    for s, e, init in [(0, 20, False), (20, 45, True)]:
        cu = torch.tensor([0, e - s])
        out.append(kda_prefill(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], 0.25, cu, pool, slot, torch.tensor([init])))
    for t in range(45, T):
        step = [x[t : t + 1] for x in (q, k, v, g, beta)]
        out.append(kda_decode(*step, 0.25, pool, slot))
    torch.testing.assert_close(torch.cat(out), o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool[2], s_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or not torch.cuda.is_available(), reason="needs fla-core and CUDA"
)
def test_against_fla_naive_recurrent():
    from fla.ops.kda.naive import naive_recurrent_kda as fla_naive

    q, k, v, g, beta = random_inputs(37)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, 0.25)
    o, s = fla_naive(q[None], k[None], v[None], g[None], beta[None], scale=0.25, output_final_state=True)
    torch.testing.assert_close(o[0].float(), o_ref, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(s[0].float(), s_ref, atol=1e-4, rtol=1e-3)


def raw_inputs(T, H=2, K=16, V=32, gen=None, dtype=torch.float32):
    """Raw layer outputs: un-normalised q, k, gate logits before dt_bias, beta logits; and the gate params."""
    q, k, v = (torch.randn(T, H, n, generator=gen).to(dtype) for n in (K, K, V))
    gate_logits = torch.randn(T, H, K, generator=gen).to(dtype)
    beta_logits = torch.randn(T, H, generator=gen).to(dtype)
    A_log = torch.rand(H, generator=gen).mul(2).log1p().to(dtype)
    gate = KDAGate(A_log=A_log, dt_bias=torch.randn(H * K, generator=gen))
    return q, k, v, gate_logits, beta_logits, gate


def activated(q, k, g, beta, gate):
    return l2norm(q.float()), l2norm(k.float()), kda_gate(g, gate.A_log, gate.dt_bias), torch.sigmoid(beta.float())


def test_kda_gate_formula():
    raw, A_log, dt_bias = torch.randn(4, 3, 8), torch.randn(3), torch.randn(24)
    ref = -A_log.exp().view(1, 3, 1) * torch.nn.functional.softplus(raw + dt_bias.view(1, 3, 8))
    torch.testing.assert_close(kda_gate(raw, A_log, dt_bias), ref)


def test_raw_inputs_with_gate_equal_activated_inputs():
    """gate=KDAGate(...) applies l2 norms, decay and sigmoid in the backend: same as doing it first."""
    gen = torch.Generator().manual_seed(7)
    lens = [3, 30]
    cu = torch.tensor([0, 3, 33])
    q, k, v, g, beta, gate = raw_inputs(sum(lens), gen=gen)
    pool_raw, pool_ref = torch.randn(4, 2, 16, 32, generator=gen).repeat(2, 1, 1, 1, 1).unbind(0)
    pool_raw, pool_ref = pool_raw.clone(), pool_ref.clone()
    slots, has_initial = torch.tensor([2, 0]), torch.tensor([True, False])
    o = kda_prefill(q, k, v, g, beta, 0.25, cu, pool_raw, slots, has_initial, gate=gate)
    qa, ka, ga, ba = activated(q, k, g, beta, gate)
    o_ref = kda_prefill(qa, ka, v, ga, ba, 0.25, cu, pool_ref, slots, has_initial)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool_raw, pool_ref, atol=1e-6, rtol=1e-6)
    q, k, v, g, beta, _ = raw_inputs(2, gen=gen)
    o = kda_decode(q, k, v, g, beta, 0.25, pool_raw, slots, gate=gate)
    qa, ka, ga, ba = activated(q, k, g, beta, gate)
    o_ref = kda_decode(qa, ka, v, ga, ba, 0.25, pool_ref, slots)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool_raw, pool_ref, atol=1e-6, rtol=1e-6)


def test_shipped_fla_configs_are_well_formed(monkeypatch, tmp_path):
    """Every shipped fla config file parses the way fla reads it; no CUDA here, so nothing is set."""
    import json

    from deltaserve.ops.kda import fla_tuning

    files = sorted(fla_tuning.TUNED_DIR.glob("*/*.json"))
    assert files, "no shipped fla configs"
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem
        for entry in data["autotune_entries"].values():
            assert {"kwargs", "num_warps", "num_stages"} <= set(entry["config"])
    assert fla_tuning.gpu_dir_name("NVIDIA H200") == "NVIDIA_H200"
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    if not torch.cuda.is_available():
        assert fla_tuning.use_shipped_configs() is None
