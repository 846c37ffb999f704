"""MLA prefill attention: new tokens over their cached prefix plus themselves, with K/V expanded.

On CUDA it runs PyTorch's fused scaled-dot-product attention (never materialising the [H, n, L]
scores, which for a 32k prompt would be 128 GB in float32), new token i seeing keys j <= num_context + i.
Which fused kernel, measured on an H100 at the 48B shape (benchmarks/gpu_checks/mla_prefill_attention.py,
docs/performance.md):
- cuDNN is the fastest (585 TFLOP/s on a 32k prompt, against 275 for the flash kernel) and takes V of
  128 against the 192-wide q/k as it is. But it builds an execution plan for every new shape: 38 ms for a
  prompt length it has not seen, 540-680 ms for a chunk after cached context. So it runs only on prompts
  without cached context of at least CUDNN_MIN_TOKENS, their length padded up to a multiple of
  CUDNN_BUCKET_TOKENS (queries, keys and values padded at the end: under the causal mask no real row sees
  a padded key, so the result is exact), which bounds the plans a process builds.
- Everything else runs the flash kernel (no plan), which wants one head size: V is zero-padded to 192.
Other dtypes (float32) run what SDPA picks among the flash, memory-efficient and math kernels. Off CUDA,
and as the test oracle, `naive.attention_expanded`.

A chunk after a long cached context attends to it in pieces (`attention_prefill_with_lse`, merged by
log-sum-exp in the MLA layer), so its expanded K/V never hold the whole context at once; those pieces run
the flash kernel (half precision, V padded) or the memory-efficient kernel (float32), both of which return
the log-sum-exp and build no plan.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deltaserve.ops.mla.naive import attention_expanded, attention_with_lse

logger = logging.getLogger(__name__)

# prompts without cached context this long or longer go to cuDNN: below it the flash kernel's extra time
# over all MLA layers is smaller than one plan (a 4k prompt: 0.9 against 0.4 ms a layer, 38 ms a plan)
CUDNN_MIN_TOKENS = 4096
# their lengths padded up to a multiple of this: at most 28 plans up to a 32k prompt, at most 1023 padded rows
CUDNN_BUCKET_TOKENS = 1024
# the kernels SDPA may choose among outside the cuDNN path: none of them builds per-shape plans
NO_PLAN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[L, H, D] -> [1, H, L, D] views."""
    return [t.transpose(0, 1).unsqueeze(0) for t in tensors]


def attention_causal_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bucket: int,
                            ) -> torch.Tensor:
    """Causal attention of a prompt without cached context, its n tokens padded at the end up to a
    multiple of `bucket` (so a kernel that plans per shape sees few shapes). q, k: [n, H, Dqk],
    v: [n, H, Dv] -> [n, H, Dv]. Exact: under the causal mask row i < n sees keys <= i only."""
    n = q.shape[0]
    pad = -n % bucket
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    qh, kh, vh = _heads_first(q, k, v)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return out[0, :, :n].transpose(0, 1)


@functools.cache
def _cudnn_usable(device_index: int) -> bool:
    """cuDNN's SDPA on this GPU: enabled in torch, and Hopper or later (where it was measured)."""
    return torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(device_index)[0] >= 9


_cudnn_failed: set[int] = set()


def _try_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The cuDNN path, or None where cuDNN is not usable or refuses (then never tried again on the device)."""
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index in _cudnn_failed or not _cudnn_usable(index):
        return None
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return attention_causal_padded(q, k, v, scale, CUDNN_BUCKET_TOKENS)
    except RuntimeError as e:
        _cudnn_failed.add(index)
        logger.warning("cuDNN attention refused a prefill on cuda:%d (%s); the flash kernel runs instead", index, e)
        return None


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_context: int,
                   ) -> torch.Tensor:
    """q: [n, H, Dqk], k: [num_context + n, H, Dqk], v: [num_context + n, H, Dv] -> [n, H, Dv] in q.dtype."""
    n, num_keys = q.shape[0], k.shape[0]
    if num_keys != num_context + n:
        raise ValueError(f"k has {num_keys} tokens but num_context + n = {num_context} + {n}")
    k, v = k.to(q.dtype), v.to(q.dtype)
    half = q.dtype in (torch.bfloat16, torch.float16)
    if half and q.device.type == "cuda" and num_context == 0 and n >= CUDNN_MIN_TOKENS:
        out = _try_cudnn(q, k, v, scale)
        if out is not None:
            return out
    dv = v.shape[-1]
    if half and dv < q.shape[-1]:  # the flash kernel wants one head size
        v = F.pad(v, (0, q.shape[-1] - dv))
    qh, kh, vh = _heads_first(q, k, v)
    with sdpa_kernel(NO_PLAN_BACKENDS):
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


def attention_prefill_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes and meaning as `naive.attention_with_lse`: (o [n, H, Dv] float32, lse [n, H] float32).
    CUDA: the flash kernel in half precision, the memory-efficient kernel otherwise (V zero-padded to the
    q/k head size for both, which changes neither o nor lse); other devices: the float32 reference."""
    if q.device.type != "cuda":
        return attention_with_lse(q, k, v, scale, causal)
    n, dv = q.shape[0], v.shape[-1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    qh, kh, vh = _heads_first(q, k, v)
    if q.dtype in (torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale)[:2]
    # out [1, H, n, D]; lse [1, H, n'] with n' >= n (the memory-efficient kernel pads its rows)
    return out[0, :, :, :dv].transpose(0, 1).float(), lse[0, :, :n].transpose(0, 1).float()
