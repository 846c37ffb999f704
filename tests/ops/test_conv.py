"""Short causal convolution against torch's conv1d, across chunks, decodes and short sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.conv import causal_conv1d_decode, causal_conv1d_prefill

D, W = 12, 4


def reference(x, weight):
    """x: [T, D] one whole sequence from zeros -> silu(causal depthwise conv)."""
    y = F.conv1d(x.t()[None], weight[:, None, :], padding=W - 1, groups=D)[0, :, : x.shape[0]]
    return F.silu(y).t()


def test_prefill_varlen_matches_conv1d_and_leaves_other_slots():
    weight = torch.randn(D, W)
    lens = [7, 1, 2, 20]
    x = torch.randn(sum(lens), D)
    cu = torch.tensor([0, 7, 8, 10, 30])
    pool = torch.full((6, D, W - 1), float("nan"))
    keep = pool[[0, 5]].clone()
    y = causal_conv1d_prefill(x, weight, cu, pool, torch.tensor([1, 2, 3, 4]), torch.tensor([False] * 4))
    for i in range(4):
        s, e = cu[i].item(), cu[i + 1].item()
        torch.testing.assert_close(y[s:e], reference(x[s:e], weight), atol=1e-5, rtol=1e-5)
        padded = torch.cat([torch.zeros(W - 1, D), x[s:e]])
        torch.testing.assert_close(pool[i + 1], padded[-(W - 1) :].t())
    assert torch.equal(pool[[0, 5]].isnan(), keep.isnan())


def test_chunks_and_decodes_continue_the_sequence():
    weight = torch.randn(D, W)
    x = torch.randn(15, D)
    ref = reference(x, weight)
    pool = torch.randn(2, D, W - 1)
    slot = torch.tensor([1])
    parts = []
    for s, e, init in [(0, 2, False), (2, 3, True), (3, 11, True)]:  # includes chunks shorter than W - 1
        parts.append(causal_conv1d_prefill(x[s:e], weight, torch.tensor([0, e - s]), pool, slot, torch.tensor([init])))
    for t in range(11, 15):
        parts.append(causal_conv1d_decode(x[t : t + 1], weight, pool, slot))
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-5, rtol=1e-5)
