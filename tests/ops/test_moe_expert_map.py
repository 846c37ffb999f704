"""Routed experts under expert parallelism: `fused_moe(..., expert_map)` on one rank's experts.

Each of `ep` ranks holds a contiguous range of experts; the partial sums of all ranks must add up to
the whole model's routed output, each rank's part must equal the float64 loop over its own experts
only, and a token none of whose experts a rank holds must come out exactly zero there (the grouped
path leaves those rows of its GEMM output unwritten: poisoned with NaN here through x's gather).
Both the grouped-GEMM path and the loop run, on fresh random inputs, float32 held to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.moe import grouped
from deltaserve.ops.moe import naive as moe_naive

IMPLS = {"loop": moe_naive.fused_moe, "grouped": grouped.grouped_fused_moe}
needs_cpu_grouped_mm = pytest.mark.skipif(
    not grouped._grouped_mm_runs_on_cpu(), reason="torch._grouped_mm has no CPU kernel before torch 2.9"
)


def _expert_map(num_experts: int, start: int, end: int) -> torch.Tensor:
    """[num_experts] long: global id -> index in [0, end - start), -1 outside the range."""
    ids = torch.arange(num_experts)
    return torch.where((ids >= start) & (ids < end), ids - start, -1)


def _loop_over(x, w13, w2, weights, ids, experts: range) -> torch.Tensor:
    """float64 [T, H]: sum over the (token, k) pairs whose expert is in `experts` (global w13/w2)."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e not in experts:
                continue
            xt, w1, w3 = x[t].double(), w13[e, :inter].double(), w13[e, inter:].double()
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(w1 @ xt) * (w3 @ xt)))
    return out


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize(("ep", "experts", "top_k", "tokens"), [(2, 8, 2, 13), (4, 16, 3, 29), (8, 8, 1, 5)])
def test_ranks_partial_sums_add_up_to_the_whole(impl: str, ep: int, experts: int, top_k: int, tokens: int) -> None:
    if impl == "grouped" and not grouped._grouped_mm_runs_on_cpu():
        pytest.skip("torch._grouped_mm has no CPU kernel before torch 2.9")
    hidden, inter = 32, 16
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter) / inter**0.5
    ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k) + 0.1
    per_rank = experts // ep
    total = torch.zeros(tokens, hidden, dtype=torch.float64)
    for rank in range(ep):
        start, end = rank * per_rank, (rank + 1) * per_rank
        local_w13, local_w2 = w13[start:end].contiguous(), w2[start:end].contiguous()
        got = IMPLS[impl](x, local_w13, local_w2, weights, ids, _expert_map(experts, start, end))
        assert got.shape == x.shape and torch.isfinite(got).all()
        want = _loop_over(x, w13, w2, weights, ids, range(start, end))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        untouched = ~((ids >= start) & (ids < end)).any(dim=-1)
        assert torch.equal(got[untouched], torch.zeros_like(got[untouched])), f"rank {rank}: tokens with no expert here"
        total += got.double()
    torch.testing.assert_close(total, _loop_over(x, w13, w2, weights, ids, range(experts)), rtol=1e-5, atol=1e-5)


@needs_cpu_grouped_mm
def test_grouped_ignores_garbage_past_the_local_rows() -> None:
    """Rows of other ranks' pairs are not computed: NaN in the tokens only other ranks' experts see
    must not reach this rank's output."""
    hidden, inter, experts = 32, 16, 8
    x = torch.randn(6, hidden)
    x[3] = float("nan")  # token 3 goes to experts 4 and 5 only, which another rank holds
    ids = torch.tensor([[0, 4], [1, 2], [3, 5], [4, 5], [0, 3], [2, 6]])
    weights = torch.rand(6, 2) + 0.1
    w13 = torch.randn(4, 2 * inter, hidden) / hidden**0.5
    w2 = torch.randn(4, hidden, inter) / inter**0.5
    expert_map = _expert_map(experts, 0, 4)
    got = grouped.grouped_fused_moe(x, w13, w2, weights, ids, expert_map)
    assert torch.isfinite(got).all() and torch.equal(got[3], torch.zeros(hidden))
    torch.testing.assert_close(got, moe_naive.fused_moe(x, w13, w2, weights, ids, expert_map), rtol=1e-5, atol=1e-5)
