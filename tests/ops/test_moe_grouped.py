"""The grouped-GEMM routed experts (`grouped.py`) against the expert loop (`naive.fused_moe`).

Fresh random inputs every run. float32 is held to 1e-5; bf16 to a 1e-2 relative error, since the
loop rounds to bf16 after every expert's index_add while the grouped path sums the K pairs once.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.moe import fused_moe_impl, grouped
from deltaserve.ops.moe import naive as moe_naive

BF16_REL_TOL = 1e-2
CPU = torch.device("cpu")
needs_cpu_grouped_mm = pytest.mark.skipif(
    not grouped._grouped_mm_runs_on_cpu(), reason="torch._grouped_mm has no CPU kernel before torch 2.9"
)


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device):
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    return w13, w2


def _distinct_ids(tokens: int, top_k: int, allowed: torch.Tensor) -> torch.Tensor:
    """[tokens, top_k] long: per token, top_k distinct experts drawn from `allowed`."""
    scores = torch.rand(tokens, allowed.numel(), device=allowed.device)
    return allowed[scores.topk(top_k, dim=-1).indices]


def _routing(tokens: int, experts: int, top_k: int, device: torch.device = CPU):
    """Ids that never pick the first, the last and one middle expert (empty groups at both ends
    and inside), and float32 weights in [0.1, 1.1)."""
    skipped = {0, experts - 1, experts // 2}
    allowed = torch.tensor([e for e in range(experts) if e not in skipped], device=device)
    ids = _distinct_ids(tokens, top_k, allowed)
    weights = torch.rand(tokens, top_k, device=device) + 0.1
    return weights, ids


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _check(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert _rel_err(got, ref) < BF16_REL_TOL
        torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2 * ref.float().abs().max().item())


@needs_cpu_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 4)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_matches_loop(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    hidden, inter = 64, 32
    x = torch.randn(tokens, hidden).to(dtype)
    w13, w2 = _weights(experts, hidden, inter, dtype, CPU)
    weights, ids = _routing(tokens, experts, top_k)
    assert grouped.grouped_mm_supported(x, w13, w2)
    x_before = x.clone()
    got = grouped.grouped_fused_moe(x, w13, w2, weights, ids)
    _check(got, moe_naive.fused_moe(x, w13, w2, weights, ids))
    assert torch.equal(x, x_before)
    # no atomics: bitwise reproducible
    assert torch.equal(got, grouped.grouped_fused_moe(x, w13, w2, weights, ids))


@needs_cpu_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 4])
def test_one_expert_gets_every_token(top_k: int, dtype: torch.dtype) -> None:
    tokens, experts, hidden, inter, busy = 40, 8, 64, 32, 5
    x = torch.randn(tokens, hidden).to(dtype)
    w13, w2 = _weights(experts, hidden, inter, dtype, CPU)
    others = torch.tensor([e for e in range(experts) if e != busy])
    ids = torch.cat([torch.full((tokens, 1), busy), _distinct_ids(tokens, top_k - 1, others)], dim=1)
    ids = ids.gather(1, torch.rand(tokens, top_k).argsort(dim=1))  # the busy expert in any slot
    weights = torch.rand(tokens, top_k) + 0.1
    order, offs = grouped.permute_by_expert(ids, experts)
    assert (offs[busy] - (offs[busy - 1] if busy else 0)).item() == tokens
    _check(grouped.grouped_fused_moe(x, w13, w2, weights, ids), moe_naive.fused_moe(x, w13, w2, weights, ids))


@needs_cpu_grouped_mm
def test_float32_grouped_matches_float64_loop() -> None:
    tokens, experts, top_k, hidden, inter = 33, 16, 4, 64, 32
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    w13, w2 = _weights(experts, hidden, inter, torch.float64, CPU)
    weights, ids = _routing(tokens, experts, top_k)
    ref = moe_naive.fused_moe(x, w13, w2, weights.double(), ids)
    got = grouped.grouped_fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@needs_cpu_grouped_mm
def test_large_batches_run_in_token_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, experts, top_k, hidden, inter = 50, 8, 2, 64, 32
    x = torch.randn(tokens, hidden)
    w13, w2 = _weights(experts, hidden, inter, torch.float32, CPU)
    weights, ids = _routing(tokens, experts, top_k)
    whole = grouped.grouped_fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(grouped, "MAX_OPERAND_ELEMENTS", 7 * top_k * hidden)  # chunks of 7 tokens
    # smaller GEMMs may block their sums differently: float32 rounding, not a wrong row (1e-6 failed now and then)
    torch.testing.assert_close(grouped.grouped_fused_moe(x, w13, w2, weights, ids), whole, rtol=1e-5, atol=1e-5)


def test_permute_by_expert_groups_pairs_stably() -> None:
    tokens, experts, top_k = 50, 16, 4
    _, ids = _routing(tokens, experts, top_k)
    order, offs = grouped.permute_by_expert(ids, experts)
    flat = ids.reshape(-1)
    assert offs.dtype == torch.int32 and offs.shape == (experts,)
    assert torch.equal(offs.long(), torch.bincount(flat, minlength=experts).cumsum(0))
    assert torch.equal(order.sort().values, torch.arange(tokens * top_k))  # a permutation
    sorted_ids = flat[order]
    assert torch.equal(sorted_ids, flat.sort().values)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    for e, (s, t) in enumerate(zip(starts, offs.tolist(), strict=True)):
        assert (sorted_ids[s:t] == e).all()
        assert torch.equal(order[s:t], order[s:t].sort().values)  # stable: token order kept within an expert
    assert offs[0].item() == 0 and offs[-2].item() == offs[-1].item() == tokens * top_k  # experts 0, E-1 unused


def test_dispatch_and_fallbacks() -> None:
    assert fused_moe_impl(CPU) is grouped.fused_moe
    assert fused_moe_impl(torch.device("meta")) is moe_naive.fused_moe
    tokens, experts, top_k = 9, 8, 2
    weights, ids = _routing(tokens, experts, top_k)
    # rows of 12 bf16 (24 bytes) break the 16-byte stride rule; float64 has no grouped kernel
    for hidden, inter, dtype in [(12, 32, torch.bfloat16), (64, 12, torch.bfloat16), (64, 32, torch.float64)]:
        x = torch.randn(tokens, hidden).to(dtype)
        w13, w2 = _weights(experts, hidden, inter, dtype, CPU)
        assert not grouped.grouped_mm_supported(x, w13, w2)
        assert torch.equal(grouped.fused_moe(x, w13, w2, weights, ids), moe_naive.fused_moe(x, w13, w2, weights, ids))
    x = torch.randn(tokens, 64)
    w13, w2 = _weights(experts, 64, 32, torch.float32, CPU)
    assert not grouped.grouped_mm_supported(x.bfloat16(), w13, w2)  # mixed dtypes
    w13_cols = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major rows
    assert not grouped.grouped_mm_supported(x, w13_cols, w2)
    torch.testing.assert_close(grouped.fused_moe(x, w13_cols, w2, weights, ids),
                               grouped.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    empty = grouped.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 64) and empty.dtype == torch.float32


# --- CUDA: the real Kimi-Linear-48B-A3B shape -------------------------------------------------

REAL_EXPERTS, REAL_TOP_K, REAL_HIDDEN, REAL_INTER = 256, 8, 2304, 1024


def _cuda_grouped_ready() -> bool:
    return torch.cuda.is_available() and grouped._fast_cuda_device(torch.cuda.current_device())


needs_cuda_grouped = pytest.mark.skipif(not _cuda_grouped_ready(), reason="needs a CUDA sm90/sm100 device")


@pytest.fixture(scope="module")
def real_weights():
    dev = torch.device("cuda")
    return _weights(REAL_EXPERTS, REAL_HIDDEN, REAL_INTER, torch.bfloat16, dev)


@needs_cuda_grouped
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_cuda_real_shape_matches_loop(tokens: int, real_weights) -> None:
    w13, w2 = real_weights
    dev = w13.device
    x = torch.randn(tokens, REAL_HIDDEN, device=dev).bfloat16()
    weights, ids = _routing(tokens, REAL_EXPERTS, REAL_TOP_K, dev)
    assert fused_moe_impl(dev) is grouped.fused_moe and grouped.grouped_mm_supported(x, w13, w2)
    _check(grouped.fused_moe(x, w13, w2, weights, ids), moe_naive.fused_moe(x, w13, w2, weights, ids))


@needs_cuda_grouped
def test_cuda_graph_replay_follows_new_routing(real_weights) -> None:
    w13, w2 = real_weights
    dev, tokens = w13.device, 64
    x = torch.randn(tokens, REAL_HIDDEN, device=dev).bfloat16()
    weights, ids = _routing(tokens, REAL_EXPERTS, REAL_TOP_K, dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch recommends
        grouped.grouped_fused_moe(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped.grouped_fused_moe(x, w13, w2, weights, ids)
    new_weights, new_ids = _routing(tokens, REAL_EXPERTS, REAL_TOP_K, dev)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    _check(out.clone(), moe_naive.fused_moe(x, w13, w2, weights, ids))
