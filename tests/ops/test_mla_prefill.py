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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,pieces", [(1, [5]), (7, [16, 16, 3]), (12, [8, 1])])
def test_context_in_pieces_merged_by_lse_equals_one_pass(device, dtype, n, pieces):
    """A chunk after cached context: causal attention over its own tokens, then each context piece
    without a mask, merged by log-sum-exp, equals one pass over context and chunk together."""
    from deltaserve.ops.mla.naive import merge_attention_states
    from deltaserve.ops.mla.prefill import attention_prefill_with_lse

    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bfloat16 runs the flash kernel on CUDA only; the CPU path is the float32 reference")
    heads, dqk, dv = 3, 24, 16
    num_context = sum(pieces)
    gen = torch.Generator().manual_seed(n + num_context)
    q, k, v = (torch.randn(size, heads, d, generator=gen).to(device, dtype)
               for size, d in ((n, dqk), (num_context + n, dqk), (num_context + n, dv)))
    scale = dqk**-0.5
    o, lse = attention_prefill_with_lse(q, k[num_context:], v[num_context:], scale, causal=True)
    assert o.shape == (n, heads, dv) and lse.shape == (n, heads) and o.dtype == lse.dtype == torch.float32
    start = 0
    for size in pieces:
        part = slice(start, start + size)
        o, lse = merge_attention_states(o, lse, *attention_prefill_with_lse(q, k[part], v[part], scale, causal=False))
        start += size
    expected = attention_expanded(q.float(), k.float(), v.float(), scale, num_context)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o, expected, atol=tol, rtol=tol)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), k.float()) * scale
    keys, queries = torch.arange(num_context + n, device=device), torch.arange(n, device=device)
    visible = keys[None, :] <= queries[:, None] + num_context
    expected_lse = scores.masked_fill(~visible[:, None, :], float("-inf")).logsumexp(dim=-1)
    torch.testing.assert_close(lse, expected_lse, atol=tol * 10, rtol=tol)


def test_causal_attention_with_lse_wants_square_inputs():
    from deltaserve.ops.mla.naive import attention_with_lse

    with pytest.raises(ValueError, match="as many keys as queries"):
        attention_with_lse(torch.zeros(2, 1, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), 1.0, causal=True)


@pytest.mark.parametrize("start,end", [(0, 40), (16, 40), (5, 37), (33, 33), (47, 48)])
def test_gather_latents_from_a_start_position(start, end):
    from deltaserve.ops.mla.naive import gather_latents

    cache = torch.randn(6, 16, 3)
    block_ids = torch.tensor([4, 0, 5, 2])
    whole = cache[block_ids].flatten(0, 1)
    torch.testing.assert_close(gather_latents(cache, block_ids, end, start=start), whole[start:end], atol=0, rtol=0)
    with pytest.raises(ValueError, match="start"):
        gather_latents(cache, block_ids, 10, start=11)
