"""fla-core's KDA kernels (the GPU path) against the torch references, through the same entry points.

Raw inputs (gate=KDAGate): the l2 norms, decay and beta sigmoid run fused inside fla. Pools are poisoned
(NaN in slots that must not be read, 1e30 in slots that must not be written), slots are shuffled, and
decode updates the pool in place by index. Skipped without CUDA and fla-core.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.kda import KDAGate, kda_decode, kda_prefill

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or not torch.cuda.is_available(), reason="needs fla-core and CUDA"
)

H, K, V = 4, 128, 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(gen, T, dtype):
    q, k, v = (torch.randn(T, H, d, generator=gen).to(dtype) for d in (K, K, V))
    g = torch.randn(T, H, K, generator=gen).to(dtype)
    beta = torch.randn(T, H, generator=gen).to(dtype)
    gate = KDAGate(torch.rand(H, generator=gen).mul(3).log1p().to(dtype), torch.randn(H * K, generator=gen) - 2)
    return q, k, v, g, beta, gate


def to_cuda(xs):
    return [KDAGate(x.A_log.cuda(), x.dt_bias.cuda()) if isinstance(x, KDAGate) else x.cuda() for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_then_decode_match_torch(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lens = [1, 63, 64, 65, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta, gate = make(gen, sum(lens), dtype)
    num_slots = 12
    pool = torch.randn(num_slots, H, K, V, generator=gen) * 0.1
    slots = torch.tensor([7, 2, 9, 0, 4])
    has_initial = torch.tensor([True, False, True, False, True])
    pool[2], pool[0] = float("nan"), float("nan")  # fresh sequences: never read
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    pool[untouched] = 1e30

    outs, pools = {}, {}
    for backend in ("torch", "fla"):
        monkeypatch.setenv("DELTASERVE_KDA_BACKEND", backend)
        p = pool.clone().cuda()
        tensors = to_cuda([q, k, v, g, beta, gate])
        o = kda_prefill(*tensors[:5], 0.2, cu.cuda(), p, slots.cuda(), has_initial.cuda(), gate=tensors[5],
                        cu_seqlens_cpu=cu)
        decoded = []
        for step in range(3):
            dq, dk, dv, dg, db, _ = to_cuda(make(torch.Generator().manual_seed(step), len(lens), dtype))
            decoded.append(kda_decode(dq, dk, dv, dg, db, 0.2, p, slots.cuda().int(), gate=tensors[5]))
        outs[backend], pools[backend] = (o.float(), torch.stack(decoded).float()), p

    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert rel_err(outs["fla"][0], outs["torch"][0]) < tol, "prefill output"
    assert rel_err(outs["fla"][1], outs["torch"][1]) < tol, "decode outputs"
    used = slots.tolist()
    assert rel_err(pools["fla"][used], pools["torch"][used]) < tol, "final states"
    assert torch.equal(pools["fla"][untouched].cpu(), torch.full_like(pool[untouched], 1e30)), "untouched slots"
