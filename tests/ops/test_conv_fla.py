"""fla-core's short-convolution prefill (the GPU path) against the torch reference: packed sequences
shorter and longer than the window, with and without a pooled window to continue from, strided input
rows (as the fused projection's output), NaN in slots that must not be read. Skipped without CUDA and
fla-core."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.conv import naive
from deltaserve.ops.conv.fla_prefill import causal_conv1d_prefill_fla

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or not torch.cuda.is_available(), reason="needs fla-core and CUDA"
)

D, W = 384, 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_conv_prefill_on_cuda_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    lens = [1, 2, 3, 70, 200, 5]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    wide = torch.randn(cu[-1].item(), D + 40, generator=gen).to(dtype).cuda()
    x = wide[:, 8 : 8 + D]  # rows strided like a slice of the fused projection's output
    weight = torch.randn(D, W, generator=gen).to(dtype).cuda()
    pool = torch.randn(9, D, W - 1, generator=gen).to(dtype).cuda()
    slots = torch.tensor([7, 1, 4, 2, 8, 5]).cuda()
    has_initial = torch.tensor([True, False, True, False, True, True]).cuda()
    pool[slots[~has_initial]] = float("nan")  # never read
    outs, pools = {}, {}
    for name, fn in (("torch", naive.causal_conv1d_prefill), ("fla", causal_conv1d_prefill_fla)):
        p = pool.clone()
        kwargs = {"cu_seqlens_cpu": cu} if name == "fla" else {}
        outs[name] = fn(x, weight, cu.cuda(), p, slots, has_initial, "silu", **kwargs)
        pools[name] = p
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["fla"].float(), outs["torch"].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pools["fla"][slots].float(), pools["torch"][slots].float(), atol=0, rtol=0)
    untouched = [0, 3, 6]
    assert torch.equal(pools["fla"][untouched], pool[untouched])
