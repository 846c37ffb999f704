"""The RMS norms against transformers' Kimi Linear modules and a float64 formula."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm, KimiLinearRMSNormGated

from deltaserve.ops.norm import gated_rms_norm, rms_norm


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(shape, generator=gen) + 0.5
    weight = 1.0 + 0.3 * torch.randn(shape[-1], generator=gen)
    return x, weight


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48)])
def test_rms_norm_matches_transformers_fp32(shape: tuple[int, ...]) -> None:
    x, weight = _inputs(shape, seed=1)
    eps = 1e-5
    hf = KimiLinearRMSNorm(shape[-1], eps=eps)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    got = rms_norm(x, weight, eps)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    xd = x.double()
    exact = weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)


def test_rms_norm_bf16_cast_order_matches_transformers() -> None:
    x, weight = _inputs((9, 64), seed=2)
    x, weight = x.bfloat16(), weight.bfloat16()
    hf = KimiLinearRMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    tokens, heads, dim, eps = 6, 4, 32, 1e-5
    x, weight = _inputs((tokens, heads, dim), seed=3)
    gate = 2.0 * torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(4))
    x, gate, weight = x.to(dtype), gate.to(dtype), weight.to(dtype)
    hf = KimiLinearRMSNormGated(dim, eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x, gate)
    got = gated_rms_norm(x, gate, weight, eps)
    assert got.dtype == dtype and got.shape == (tokens, heads, dim)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    if dtype == torch.float32:
        xd = x.double()
        normed = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        exact = weight.double() * normed * torch.sigmoid(gate.double())
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
