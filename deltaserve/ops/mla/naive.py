"""Multi-head latent attention references over a paged latent cache.

The cache of one layer is kv_cache [num_blocks, block_size, R + P]: per token the normalised
latent c (R = kv_lora_rank) followed by the shared key part k_pe (P = qk_rope_head_dim).
Everything is computed in float32 whatever the cache dtype.
"""

from __future__ import annotations

import torch


def write_latents(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store each token's [c, k_pe] in its slot, in place.

    kv_cache: [num_blocks, block_size, R + P], slot_mapping: [T] long (block * block_size + offset),
    values: [T, R + P].
    """
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, values.to(kv_cache.dtype))


def gather_latents(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, start: int = 0) -> torch.Tensor:
    """One sequence's cached entries at positions [start, num_tokens), in order.

    kv_cache: [num_blocks, block_size, R + P], block_ids: [nb] long (the sequence's blocks in
    order) -> [num_tokens - start, R + P] in the cache dtype.
    """
    block_size = kv_cache.shape[1]
    needed = -(-num_tokens // block_size)
    if needed > block_ids.shape[0]:
        raise ValueError(
            f"num_tokens={num_tokens} needs {needed} blocks of {block_size} but block_ids has {block_ids.shape[0]}"
        )
    if not 0 <= start <= num_tokens:
        raise ValueError(f"start={start} must lie in [0, num_tokens={num_tokens}]")
    first = start // block_size
    offset = start - first * block_size
    return kv_cache[block_ids[first:needed]].flatten(0, 1)[offset: num_tokens - first * block_size]


def attention_expanded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_context: int
) -> torch.Tensor:
    """Causal attention of n new tokens over num_context cached tokens plus themselves.

    q: [n, H, Dqk], k: [num_context + n, H, Dqk], v: [num_context + n, H, Dv] -> [n, H, Dv] in
    q.dtype. New token i sees keys j <= num_context + i. Scores, softmax and the value sum run in
    float32.
    """
    n, num_keys = q.shape[0], k.shape[0]
    if num_keys != num_context + n:
        raise ValueError(f"k has {num_keys} tokens but num_context + n = {num_context} + {n}")
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * scale
    rows = torch.arange(n, device=q.device)[:, None] + num_context
    future = torch.arange(num_keys, device=q.device)[None, :] > rows
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnl,lhv->nhv", probs, v.float()).to(q.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of n queries over L keys, with the log-sum-exp of each row's scores, in float32.

    q: [n, H, Dqk], k: [L, H, Dqk], v: [L, H, Dv] -> (o [n, H, Dv] float32, lse [n, H] float32, the
    natural-log sum of exp scores). causal: keys and queries are the same positions (L = n) and query i
    sees keys j <= i; otherwise every query sees every key. The parts over disjoint key sets combine
    with `merge_attention_states`.
    """
    n, num_keys = q.shape[0], k.shape[0]
    if causal and num_keys != n:
        raise ValueError(f"causal attention wants as many keys as queries, got {num_keys} keys for {n} queries")
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * scale
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    probs = _safe_exp_weights(scores, lse)
    return torch.einsum("hnl,lhv->nhv", probs, v.float()), lse.transpose(0, 1)


def _safe_exp_weights(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse) with rows whose lse is -inf (no keys) giving zeros instead of NaN."""
    shift = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    return torch.exp(scores - shift.unsqueeze(-1))


def check_decode_shapes(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                        ) -> None:
    """ValueError unless q_latent [.., R] and q_pe [.., P] fit kv_lora_rank = R and cache entries of R + P."""
    rank = q_latent.shape[-1]
    if rank != kv_lora_rank or kv_cache.shape[-1] != kv_lora_rank + q_pe.shape[-1]:
        raise ValueError(
            f"q_latent [.., {rank}] and q_pe [.., {q_pe.shape[-1]}] do not match kv_lora_rank={kv_lora_rank} "
            f"and cache entries of {kv_cache.shape[-1]}"
        )


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: one query token per sequence over its cached latents.

    max_seq_len: an optional host-side bound on seq_lens for fast kernels; the reference ignores it.

    q_latent: [B, H, R] (q_nope folded through W_UK), q_pe: [B, H, P],
    kv_cache: [num_blocks, block_size, R + P], block_tables: [B, max_blocks] long (entries past a
    sequence's blocks are arbitrary), seq_lens: [B] long (cached tokens, the new one included).
    Returns (o_latent [B, H, R] float32, lse [B, H] float32) with
    score_j = scale * (q_latent . c_j + q_pe . k_pe_j), o_latent = softmax(score) . c,
    lse = logsumexp(score) (natural log). A sequence with no tokens gives o = 0, lse = -inf.
    """
    check_decode_shapes(q_latent, q_pe, kv_cache, kv_lora_rank)
    batch = q_latent.shape[0]
    block_size = kv_cache.shape[1]
    max_len = int(seq_lens.max()) if batch else 0
    num_blocks = max(1, -(-max_len // block_size))
    # padding entries may hold any id, even out of range: point them at block 0 and mask below
    blocks_used = (seq_lens + block_size - 1) // block_size
    in_use = torch.arange(num_blocks, device=block_tables.device)[None, :] < blocks_used[:, None]
    tables = torch.where(in_use, block_tables[:, :num_blocks], torch.zeros_like(block_tables[:, :num_blocks]))
    entries = kv_cache[tables].flatten(1, 2)[:, :max_len].float()  # [B, L, R + P]
    valid = torch.arange(entries.shape[1], device=seq_lens.device)[None, :] < seq_lens[:, None]  # [B, L]
    # zero, not just mask, the stray entries: NaN or huge values would leak through 0 * x
    entries = entries.masked_fill(~valid[..., None], 0.0)
    c, k_pe = entries[..., :kv_lora_rank], entries[..., kv_lora_rank:]
    scores = torch.einsum("bhr,blr->bhl", q_latent.float(), c) + torch.einsum("bhp,blp->bhl", q_pe.float(), k_pe)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o_latent = torch.einsum("bhl,blr->bhr", _safe_exp_weights(scores, lse), c)
    return o_latent, lse


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets into the attention over their union.

    o_a, o_b: [..., H, D], lse_a, lse_b: [..., H] (natural-log sum of exp scores of each part)
    -> (o [..., H, D] float32, lse [..., H] float32). A part with lse = -inf (no keys) contributes
    nothing; two empty parts give o = 0, lse = -inf.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    shift = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - shift).unsqueeze(-1)
    w_b = torch.exp(lse_b - shift).unsqueeze(-1)
    return w_a * o_a.float() + w_b * o_b.float(), lse


def merge_partial_attentions(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine N partial attentions over disjoint key sets (DCP ranks' stripes) into one, in float32.

    o_parts: [N, ..., H, D], lse_parts: [N, ..., H] -> (o [..., H, D] float32, lse [..., H] float32).
    Parts with lse = -inf (no keys on that rank) contribute nothing; all empty gives o = 0, lse = -inf.
    Equal to folding `merge_attention_states` over the parts; float32 throughout, since a bf16 merge
    is known to cost accuracy.
    """
    lse_parts = lse_parts.float()
    lse = torch.logsumexp(lse_parts, dim=0)
    shift = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    weights = torch.exp(lse_parts - shift).unsqueeze(-1)  # [N, ..., H, 1]; exp(-inf) = 0 for empty parts
    return (weights * o_parts.float()).sum(dim=0), lse
