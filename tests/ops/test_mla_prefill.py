"""MLA prefill through fused SDPA against the float32 reference, on random inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.mla.naive import attention_expanded
from deltaserve.ops.mla.prefill import CUDNN_MIN_TOKENS, attention_causal_padded, attention_prefill, attention_sdpa

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


@pytest.mark.parametrize("n,bucket", [(5, 8), (8, 8), (13, 4), (1, 16)])
def test_padding_a_prompt_to_its_bucket_changes_no_real_row(n, bucket):
    heads, dqk, dv = 2, 24, 16
    q, k = torch.randn(n, heads, dqk, dtype=torch.float64), torch.randn(n, heads, dqk, dtype=torch.float64)
    v = torch.randn(n, heads, dv, dtype=torch.float64)
    got = attention_causal_padded(q, k, v, dqk**-0.5, bucket)
    assert got.shape == (n, heads, dv)
    torch.testing.assert_close(got, attention_causal_padded(q, k, v, dqk**-0.5, 1), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, attention_expanded(q, k, v, dqk**-0.5, 0).double(), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_prompt_without_context_on_cuda(dtype):
    """bf16: the cuDNN path (V of 128 as it is, the length padded to its bucket); float32: SDPA's choice."""
    n = CUDNN_MIN_TOKENS + 100
    q = torch.randn(n, 4, 192, device="cuda", dtype=dtype)
    k = torch.randn(n, 4, 192, device="cuda", dtype=dtype)
    v = torch.randn(n, 4, 256, device="cuda", dtype=dtype)[..., 128:]  # a strided view, as the layer's
    got = attention_prefill(q, k, v, 192**-0.5, 0).float()
    expected = attention_expanded(q.float(), k.float(), v.float(), 192**-0.5, 0)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
