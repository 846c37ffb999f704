"""Multi-head latent attention without positional rotation (Kimi Linear's full-attention layers).

The paged cache holds, per token, only the normalised latent (kv_lora_rank values) and the shared
k_pe (qk_rope_head_dim values). Prefill expands the latents of a sequence to per-head K/V through
kv_b_proj (after a long cached context, one piece of it at a time, the pieces' attentions merged by
log-sum-exp, so the expanded K/V stay bounded at any context length); decode folds q_nope through
W_UK, attends over the latents directly and maps the result through W_UV (the absorbed form), so
expanded K/V never exist for decoding sequences.

Under decode context parallelism (`ForwardContext.dcp`) each rank of a DCP group stores only its
stripe of every sequence's latents (`distributed/dcp_layout.py`). Decode all-gathers the folded
queries of the group's heads, attends over the local stripe, all-gathers the partial outputs and
log-sum-exps and merges its own heads' parts in float32. Prefill gathers a chunk's cached context
from the group (the new tokens' latents every rank has computed) and attends as without DCP.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig, divide
from deltaserve.distributed import dcp_all_gather, tp_all_reduce
from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.model.forward_context import PrefillSequence, get_forward_context
from deltaserve.model.layers.linear import Linear, fuse_weights
from deltaserve.model.layers.norm import RMSNorm
from deltaserve.ops.mla import (
    gather_latents,
    merge_attention_states,
    merge_partial_attentions,
    paged_mla_decode,
    write_latents,
)
from deltaserve.ops.mla.prefill import attention_prefill, attention_prefill_with_lse

# transformers builds kv_a_layernorm and q_a_layernorm with its RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MultiheadLatentAttention(nn.Module):
    """One MLA layer. The worker binds its paged cache [num_blocks, block_size, R + P] via `bind_cache`."""

    def __init__(self, config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        self.num_heads = divide(heads, parallel.tensor_parallel_size, "num_attention_heads")
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_dim = config.qk_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = self.qk_dim**-0.5
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * self.qk_dim, parallel, dtype, "column")
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, parallel, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, heads * self.qk_dim, parallel, dtype, "column")
        self.kv_a_proj_with_mqa = Linear(hidden, config.latent_dim, parallel, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), parallel, dtype, "column")
        self.o_proj = Linear(heads * self.v_dim, hidden, parallel, dtype, "row")
        self.kv_cache: torch.Tensor | None = None
        # after loading: q_proj (or q_a_proj) and kv_a_proj_with_mqa as one weight; None: two GEMMs
        self.in_proj_weight: torch.Tensor | None = None

    def fuse_input_projections(self) -> None:
        """After loading: the two projections of the layer's input as one weight (one GEMM)."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        self.in_proj_weight = fuse_weights([first, self.kv_a_proj_with_mqa])

    def bind_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> queries [T, H, qk_dim] and the new latent entries before the norm [T, R + P]."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if self.in_proj_weight is None:
            q, kv_a = first(x), self.kv_a_proj_with_mqa(x)
        else:
            widths = [first.out_features, self.kv_a_proj_with_mqa.out_features]
            q, kv_a = F.linear(x, self.in_proj_weight).split(widths, dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.reshape(-1, self.num_heads, self.qk_dim), kv_a

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, R] and W_UV [H, Dv, R] as views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], summed over the TP group (every TP rank runs it)."""
        ctx = get_forward_context()
        q, kv_a = self._projections(x)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        entries = torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)  # [T, R + P]
        write_latents(self.kv_cache, ctx.slot_mapping, entries)

        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)
        nd = ctx.num_mla_decodes
        if nd:
            w_uk, w_uv = self._up_projections()
            q_nope, q_pe = q[:nd].split([self.nope_dim, self.rope_dim], dim=-1)
            q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
            if ctx.dcp is None:
                o_latent, _ = paged_mla_decode(
                    q_latent, q_pe, self.kv_cache, ctx.decode_block_tables, ctx.decode_seq_lens,
                    self.scale, self.kv_lora_rank, max_seq_len=ctx.decode_max_seq_len,
                )
            else:
                o_latent = self._decode_over_stripes(q_latent, q_pe, ctx.dcp)
            out[:nd] = torch.einsum("bhr,hvr->bhv", o_latent.to(x.dtype), w_uv)
        short = tuple(seq for seq in ctx.prefill_sequences if seq.num_context_tokens <= EXPANSION_GROUP_TOKENS)
        for group in _expansion_groups(short):
            # every sequence's cached latents (context and new tokens), expanded to K/V by one GEMM a group
            if ctx.dcp is None:
                latents = [gather_latents(self.kv_cache, seq.block_ids, seq.num_context_tokens + seq.num_new_tokens)
                           for seq in group]
            else:
                latents = []
                for seq in group:  # the context from the DCP group's stripes, the new tokens as computed here
                    context = self._gather_context(seq.block_ids, seq.num_context_tokens, ctx.dcp)
                    latents.append(torch.cat([context, entries[_rows(seq)].to(context.dtype)]))
            k, v = self._expand(latents[0] if len(latents) == 1 else torch.cat(latents))
            lengths = [seq.num_context_tokens + seq.num_new_tokens for seq in group]
            for seq, k_seq, v_seq in zip(group, k.split(lengths), v.split(lengths), strict=True):
                rows = _rows(seq)
                out[rows] = attention_prefill(q[rows], k_seq, v_seq, self.scale, seq.num_context_tokens)
        for seq in ctx.prefill_sequences:
            if seq.num_context_tokens > EXPANSION_GROUP_TOKENS:
                out[_rows(seq)] = self._attend_long_context(q[_rows(seq)], seq, entries, ctx.dcp)
        return tp_all_reduce(self.o_proj(out.reshape(-1, self.num_heads * self.v_dim)))

    def _expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached entries [L, R + P] -> K [L, H, qk_dim] and V [L, H, v_dim], through kv_b_proj."""
        c, kpe = latents.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_nope, kpe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1), v

    def _attend_long_context(self, q: torch.Tensor, seq: PrefillSequence, entries: torch.Tensor,
                             dcp: DCPLayout | None) -> torch.Tensor:
        """A prefill chunk after more than EXPANSION_GROUP_TOKENS of cached context: q [n, H, qk_dim] ->
        [n, H, v_dim] in q.dtype. The new tokens attend to themselves (causal), then to the context in
        pieces of at most EXPANSION_GROUP_TOKENS, each expanded to K/V on its own and merged by log-sum-exp,
        so no more than one piece's K/V exist at a time (the whole context's, at 1M tokens and 32 heads,
        would be about 40 GB)."""
        num_context = seq.num_context_tokens
        new = entries[_rows(seq)].to(self.kv_cache.dtype)  # the chunk's own latents, as written to the cache
        # under DCP the context's latents come from the group's stripes (a collective), expanded piece by piece
        context = None if dcp is None else self._gather_context(seq.block_ids, num_context, dcp)
        o, lse = attention_prefill_with_lse(q, *self._expand(new), self.scale, causal=True)
        for start in range(0, num_context, EXPANSION_GROUP_TOKENS):
            end = min(num_context, start + EXPANSION_GROUP_TOKENS)
            piece = (gather_latents(self.kv_cache, seq.block_ids, end, start=start) if context is None
                     else context[start:end])
            o_piece, lse_piece = attention_prefill_with_lse(q, *self._expand(piece), self.scale, causal=False)
            o, lse = merge_attention_states(o, lse, o_piece, lse_piece)
        return o.to(q.dtype)

    def _decode_over_stripes(self, q_latent: torch.Tensor, q_pe: torch.Tensor, dcp: DCPLayout) -> torch.Tensor:
        """Decode under DCP. q_latent: [D, H, R], q_pe: [D, H, P] (this rank's H heads) -> o_latent
        [D, H, R] float32: the group's queries over this rank's stripe, merged over the group."""
        ctx = get_forward_context()
        heads = q_latent.shape[1]
        queries = dcp_all_gather(torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1), dim=1)  # [D, dcp*H, R+P]
        group_q_latent, group_q_pe = queries.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        o_part, lse_part = paged_mla_decode(
            group_q_latent, group_q_pe, self.kv_cache, ctx.decode_block_tables, dcp.local_seq_lens(ctx.decode_seq_lens),
            self.scale, self.kv_lora_rank, max_seq_len=ctx.decode_max_seq_len,
        )
        # every rank's partial over its stripe, for the group's heads; this rank merges its own heads'
        # (an all-gather moves dcp times what an all-to-all would: simple, and the step's smallest tensors)
        o_parts = dcp_all_gather(o_part.unsqueeze(0), dim=0)  # [dcp, D, dcp*H, R] float32
        lse_parts = dcp_all_gather(lse_part.unsqueeze(0), dim=0)  # [dcp, D, dcp*H]
        mine = slice(dcp.rank * heads, (dcp.rank + 1) * heads)
        return merge_partial_attentions(o_parts[:, :, mine], lse_parts[:, :, mine])[0]

    def _gather_context(self, block_ids: torch.Tensor, num_context: int, dcp: DCPLayout) -> torch.Tensor:
        """The first num_context cached entries of one sequence [num_context, R + P], in position
        order, from every DCP rank's stripe (a collective: every rank of the group calls it)."""
        if num_context == 0:
            return self.kv_cache.new_empty(0, self.kv_cache.shape[-1])
        positions = [dcp.local_positions_of_rank(num_context, r) for r in range(dcp.size)]  # host, no sync
        lengths = [len(p) for p in positions]
        local = gather_latents(self.kv_cache, block_ids, lengths[dcp.rank])
        padded = local.new_zeros(max(lengths), local.shape[-1])
        padded[: lengths[dcp.rank]] = local
        parts = dcp_all_gather(padded.unsqueeze(0), dim=0)  # [dcp, max_len, R + P]
        context = local.new_empty(num_context, local.shape[-1])
        for r in range(dcp.size):
            context[positions[r].to(context.device)] = parts[r, : lengths[r]]
        return context


# prefill chunks whose latents are expanded together hold at most this many cached tokens (a longer one
# goes alone): one GEMM for many short chunks, without holding every long chunk's K/V at once. A chunk
# after a longer cached context expands that context in pieces of this many tokens (_attend_long_context).
# The environment variable is for tests that need pieces on a tiny model in rank processes.
EXPANSION_GROUP_TOKENS = int(os.environ.get("DELTASERVE_MLA_EXPANSION_TOKENS", "32768"))


def _rows(seq: PrefillSequence) -> slice:
    return slice(seq.token_start, seq.token_start + seq.num_new_tokens)


def _expansion_groups(sequences: tuple[PrefillSequence, ...]) -> list[list[PrefillSequence]]:
    """Consecutive prefill chunks in groups of at most EXPANSION_GROUP_TOKENS cached tokens each."""
    groups: list[list[PrefillSequence]] = []
    total = 0
    for seq in sequences:
        length = seq.num_context_tokens + seq.num_new_tokens
        if groups and total + length <= EXPANSION_GROUP_TOKENS:
            groups[-1].append(seq)
            total += length
        else:
            groups.append([seq])
            total = length
    return groups
