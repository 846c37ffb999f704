"""Kimi Delta Attention: a gated delta-rule layer with per-channel decay and a short convolution.

Per request it keeps a fixed-size state in the KDA state pool: the last `W - 1` inputs of the
convolution over q, k and v, and the float32 recurrent state [heads, K, V]. Heads are split over
tensor-parallel ranks (q/k/v, f_b, g_b and b column-split, f_a and g_a replicated, conv weights,
A_log and dt_bias by head, o_proj row-split); the state pool tensors hold this rank's heads only.
The output gate's RMSNorm is per head, so it needs no communication; o_proj's partial sums are
all-reduced over the TP group once per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig, divide
from deltaserve.distributed import tp_all_reduce
from deltaserve.model.forward_context import get_forward_context
from deltaserve.model.layers.linear import Linear, fuse_weights, sharded_param
from deltaserve.model.layers.prefill_rounds import Capture, run_in_rounds
from deltaserve.ops.conv import causal_conv1d_decode, causal_conv1d_prefill
from deltaserve.ops.kda import KDAGate, kda_decode, kda_prefill, kda_verify
from deltaserve.ops.norm import gated_rms_norm
from deltaserve.spec.state_rollback import causal_conv1d_verify_varlen


class KimiDeltaAttention(nn.Module):
    """One KDA layer. Caches are bound by the worker through `bind_state`."""

    def __init__(self, config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        world = parallel.tensor_parallel_size
        hidden = config.hidden_size
        self.head_dim = config.linear_head_dim
        self.num_heads = divide(config.linear_num_heads, world, "linear_attn_config.num_heads")
        full_dim = config.kda_qkv_dim
        self.local_dim = self.num_heads * self.head_dim
        self.conv_width = config.short_conv_kernel_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5

        self.qkv_proj = Linear(hidden, 3 * full_dim, parallel, dtype, "column", output_sizes=[full_dim] * 3)
        self.qkv_conv_weight = sharded_param(
            (3 * self.local_dim, self.conv_width), dtype, 0, parallel, piece_sizes=[full_dim] * 3
        )
        self.f_a_proj = Linear(hidden, self.head_dim, parallel, dtype)
        self.f_b_proj = Linear(self.head_dim, full_dim, parallel, dtype, "column")
        self.A_log = sharded_param((1, 1, self.num_heads, 1), dtype, 2, parallel)
        self.dt_bias = sharded_param((self.local_dim,), torch.float32, 0, parallel)
        self.b_proj = Linear(hidden, config.linear_num_heads, parallel, dtype, "column")
        self.g_a_proj = Linear(hidden, self.head_dim, parallel, dtype)
        self.g_b_proj = Linear(self.head_dim, full_dim, parallel, dtype, "column")
        self.o_norm_weight = sharded_param((self.head_dim,), dtype, None, parallel)
        self.o_proj = Linear(full_dim, hidden, parallel, dtype, "row")
        # after loading: q/k/v, f_a, b and g_a as one weight (fuse_input_projections); None: four GEMMs
        self.in_proj_weight: torch.Tensor | None = None
        self.conv_state: torch.Tensor | None = None  # [slots, 3 * local_dim, W - 1]
        self.recurrent_state: torch.Tensor | None = None  # [slots, heads, K, V] float32
        # prefix caching: write this layer's conv window / recurrent state in a slot into checkpoint units
        self.capture_conv: Capture | None = None
        self.capture_recurrent: Capture | None = None

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    def bind_captures(self, capture_conv: Capture, capture_recurrent: Capture) -> None:
        """How a checkpoint inside a prefill chunk is taken (the state store's part of an image)."""
        self.capture_conv, self.capture_recurrent = capture_conv, capture_recurrent

    def fuse_input_projections(self) -> None:
        """After loading: the four projections of the layer's input (q/k/v, f_a, b, g_a) as one weight,
        so one GEMM computes them (decode at small batches is bound by the number of kernels)."""
        self.in_proj_weight = fuse_weights([self.qkv_proj, self.f_a_proj, self.b_proj, self.g_a_proj])

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q/k/v before the conv [T, 3 * local_dim], f_a(x) and g_a(x) [T, K], and the
        beta logits [T, H] (views of one GEMM's output once fused)."""
        if self.in_proj_weight is None:
            return self.qkv_proj(x), self.f_a_proj(x), self.g_a_proj(x), self.b_proj(x)
        mixed, f_a, beta, g_a = F.linear(x, self.in_proj_weight).split(
            [3 * self.local_dim, self.head_dim, self.num_heads, self.head_dim], dim=-1)
        return mixed, f_a, g_a, beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], summed over the TP group (every TP rank runs it)."""
        ctx = get_forward_context()
        num_decodes = ctx.num_decodes
        verify = slice(num_decodes, num_decodes + ctx.num_verify_tokens)
        first_prefill_row = verify.stop
        mixed, f_a, g_a, beta = self._input_projections(x)
        # decode rows first, then verify windows, then prefill rows: each part on its own rows, joined
        conv_parts = []
        if num_decodes:
            conv_parts.append(causal_conv1d_decode(
                mixed[:num_decodes], self.qkv_conv_weight, self.conv_state, ctx.decode_state_slots
            ))
        if ctx.num_verify_tokens:
            conv_parts.append(causal_conv1d_verify_varlen(
                mixed[verify], self.qkv_conv_weight, self.conv_state, list(ctx.verify_seq_lens),
                ctx.verify_state_indices,
            ))
        if ctx.num_prefills and ctx.prefill_captures:
            rows = mixed[first_prefill_row:]
            conv_parts.append(run_in_rounds(
                lambda xs, cu, cu_cpu, slots, initial: causal_conv1d_prefill(
                    xs[0], self.qkv_conv_weight, cu, self.conv_state, slots, initial, cu_seqlens_cpu=cu_cpu),
                [rows], ctx.prefill_cu_seqlens_cpu.tolist(), ctx.prefill_state_slots, ctx.prefill_has_initial_state,
                ctx.prefill_captures, self.capture_conv, torch.empty_like(rows),
            ))
        elif ctx.num_prefills:
            conv_parts.append(causal_conv1d_prefill(
                mixed[first_prefill_row:],
                self.qkv_conv_weight,
                ctx.prefill_cu_seqlens,
                self.conv_state,
                ctx.prefill_state_slots,
                ctx.prefill_has_initial_state,
                cu_seqlens_cpu=ctx.prefill_cu_seqlens_cpu,
            ))
        # Raw q, k, gate and beta logits: the KDA backend applies the l2 norms, the decay and the sigmoid
        # (inside fla's kernels on the GPU).
        q, k, v = _join(conv_parts).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        # the decay's logits before dt_bias: -exp(A_log) * softplus(g + dt_bias) is applied by the KDA op
        g = self.f_b_proj(f_a).view(-1, self.num_heads, self.head_dim)
        gate_params = KDAGate(self.A_log, self.dt_bias)

        kda_parts = []
        if num_decodes:
            d = slice(0, num_decodes)
            kda_parts.append(kda_decode(
                q[d], k[d], v[d], g[d], beta[d], self.scale, self.recurrent_state, ctx.decode_state_slots,
                gate=gate_params,
            ))
        if ctx.num_verify_tokens:
            kda_parts.append(kda_verify(
                q[verify], k[verify], v[verify], g[verify], beta[verify], self.scale, self.recurrent_state,
                ctx.verify_cu_seqlens, list(ctx.verify_seq_lens), ctx.verify_state_indices, gate=gate_params,
            ))
        if ctx.num_prefills and ctx.prefill_captures:
            p = slice(first_prefill_row, None)
            kda_parts.append(run_in_rounds(
                lambda xs, cu, cu_cpu, slots, initial: kda_prefill(
                    *xs, self.scale, cu, self.recurrent_state, slots, initial, gate=gate_params, cu_seqlens_cpu=cu_cpu),
                [q[p], k[p], v[p], g[p], beta[p]], ctx.prefill_cu_seqlens_cpu.tolist(), ctx.prefill_state_slots,
                ctx.prefill_has_initial_state, ctx.prefill_captures, self.capture_recurrent,
                torch.empty(v[p].shape, dtype=torch.float32, device=v.device),
            ))
        elif ctx.num_prefills:
            p = slice(first_prefill_row, None)
            kda_parts.append(kda_prefill(
                q[p], k[p], v[p], g[p], beta[p], self.scale,
                ctx.prefill_cu_seqlens, self.recurrent_state,
                ctx.prefill_state_slots, ctx.prefill_has_initial_state,
                gate=gate_params, cu_seqlens_cpu=ctx.prefill_cu_seqlens_cpu,
            ))
        # in the model dtype: the norm below reads it rounded, as transformers does
        out = _join(kda_parts).to(x.dtype)
        gate = self.g_b_proj(g_a).view(-1, self.num_heads, self.head_dim)
        normed = gated_rms_norm(out, gate, self.o_norm_weight, self.eps)
        return tp_all_reduce(self.o_proj(normed.reshape(-1, self.local_dim)))


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The decode part and the prefill part of a step's rows as one tensor (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
