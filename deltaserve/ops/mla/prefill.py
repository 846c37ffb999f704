"""MLA prefill attention: new tokens over their cached prefix plus themselves, with K/V expanded.

On CUDA it runs PyTorch's fused scaled-dot-product attention (flash or memory-efficient kernels,
never materialising the [H, n, L] scores, which for a 32k prompt would be 128 GB in float32) with a
bottom-right-aligned causal mask: new token i sees keys j <= num_context + i. V is zero-padded to the
query/key head size, since MLA's v_head_dim (128) is smaller than its qk_head_dim (192) and the
flash kernel wants one head size. Elsewhere, and as the test oracle, `naive.attention_expanded`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.mla.naive import attention_expanded


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_context: int,
                   ) -> torch.Tensor:
    """q: [n, H, Dqk], k: [num_context + n, H, Dqk], v: [num_context + n, H, Dv] -> [n, H, Dv] in q.dtype."""
    n, num_keys = q.shape[0], k.shape[0]
    if num_keys != num_context + n:
        raise ValueError(f"k has {num_keys} tokens but num_context + n = {num_context} + {n}")
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.to(q.dtype), v.to(q.dtype)))  # [1, H, L, D]
    if num_context == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, num_keys), scale=scale)
    return out[0, :, :, :dv].transpose(0, 1)


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_context: int,
                      ) -> torch.Tensor:
    """Shapes as `attention_sdpa`. CUDA: fused SDPA; other devices: the float32 reference."""
    if q.device.type == "cuda":
        return attention_sdpa(q, k, v, scale, num_context)
    return attention_expanded(q, k, v, scale, num_context)
