"""MLA prefill through fused SDPA against the float32 reference, on random inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.mla.naive import attention_expanded
from deltaserve.ops.mla.prefill import attention_prefill, attention_sdpa

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,num_context", [(1, 0), (7, 0), (5, 11), (16, 33)])
def test_sdpa_matches_reference(device, n, num_context):
    heads, dqk, dv = 3, 24, 16
    q = torch.randn(n, heads, dqk, device=device)
    k = torch.randn(num_context + n, heads, dqk, device=device)
    v = torch.randn(num_context + n, heads, dv, device=device)
    scale = dqk**-0.5
    expected = attention_expanded(q, k, v, scale, num_context)
    got = attention_sdpa(q, k, v, scale, num_context)
    assert got.shape == (n, heads, dv)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_real_shape_on_cuda():
    q = torch.randn(512, 32, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(512 + 1024, 32, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(512 + 1024, 32, 128, device="cuda", dtype=torch.bfloat16)
    got = attention_prefill(q, k, v, 192**-0.5, 1024).float()
    expected = attention_expanded(q.float(), k.float(), v.float(), 192**-0.5, 1024)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
