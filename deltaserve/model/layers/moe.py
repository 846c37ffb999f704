"""The feed-forward blocks: a dense SwiGLU MLP and the sigmoid-routed mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig, divide
from deltaserve.distributed import tp_all_reduce
from deltaserve.model.layers.linear import Linear, sharded_param
from deltaserve.ops.moe import fused_moe, grouped_topk


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are fused into one column-split matrix, down is row-split.

    reduce_results: all-reduce the output over the TP group; False leaves this rank's partial sum to a
    caller that adds more to it first (SparseMoE's shared experts).
    """

    def __init__(self, hidden: int, intermediate: int, parallel: ParallelConfig, dtype: torch.dtype,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.reduce_results = reduce_results
        self.gate_up_proj = Linear(hidden, 2 * intermediate, parallel, dtype, "column",
                                   output_sizes=[intermediate, intermediate])
        self.down_proj = Linear(intermediate, hidden, parallel, dtype, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (with reduce_results, summed over the TP group: every TP rank runs it)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return tp_all_reduce(out) if self.reduce_results else out


class SparseMoE(nn.Module):
    """Routed experts (stacked, each split over ranks along its intermediate size) plus shared experts.

    The router is replicated, so every TP rank picks the same experts; the routed and shared partial
    sums are added first and all-reduced once, as in vLLM.
    """

    def __init__(self, config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        experts = config.num_experts
        local_inter = divide(inter, parallel.tensor_parallel_size, "moe_intermediate_size")
        self.config = config
        self.gate_weight = sharded_param((experts, hidden), torch.float32, None, parallel)
        self.e_score_correction_bias = sharded_param((experts,), torch.float32, None, parallel)
        # w13[e] = [w1 (gate); w3 (up)] : [2 * I, hidden]; w2[e] (down) : [hidden, I]
        self.w13 = sharded_param((experts, 2 * local_inter, hidden), dtype, 1, parallel, piece_sizes=[inter, inter])
        self.w2 = sharded_param((experts, hidden, local_inter), dtype, 2, parallel)
        self.shared_experts = (
            DenseMLP(hidden, inter * config.num_shared_experts, parallel, dtype, reduce_results=False)
            if config.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], summed over the TP group (every TP rank runs it)."""
        cfg = self.config
        router_logits = F.linear(x.float(), self.gate_weight)
        weights, ids = grouped_topk(
            router_logits, self.e_score_correction_bias, cfg.num_experts_per_token,
            cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize, cfg.routed_scaling_factor,
        )
        out = fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out)
