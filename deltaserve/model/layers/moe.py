"""The feed-forward blocks: a dense SwiGLU MLP and the sigmoid-routed mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig, divide
from deltaserve.distributed import tp_all_reduce
from deltaserve.model.layers.linear import Linear, copy_shard, sharded_param
from deltaserve.ops.activation import silu_and_mul
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
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return tp_all_reduce(out) if self.reduce_results else out


def expert_param(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    split_dim: int,
    parallel: ParallelConfig,
    num_experts: int,
) -> nn.Parameter:
    """This rank's stack of routed-expert matrices, `shape` = [local experts, rows, cols].

    Its `weight_loader(param, loaded, piece, expert_id)` takes one checkpoint matrix of global expert
    `expert_id`: w2 [hidden, I] (piece None) or w1 / w3 [I, hidden] (piece 0 / 1, the halves of
    w13's rows). Without expert parallelism every rank holds every expert and copies its 1/tp slice
    along the intermediate size (`split_dim` of one expert's matrix: 0 for w1/w3, 1 for w2); with it,
    a rank copies the whole matrix of its own experts and ignores the others (another rank holds them).
    """
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    start, end = parallel.local_expert_range(num_experts)
    # the intermediate size is split over the TP group only when the experts are not
    world, rank = (1, 0) if parallel.uses_expert_parallel else (parallel.tensor_parallel_size,
                                                                 parallel.tensor_parallel_rank)

    def loader(p: torch.Tensor, loaded: torch.Tensor, piece: int | None, expert_id: int) -> None:
        if not 0 <= expert_id < num_experts:
            raise ValueError(f"expert {expert_id} is out of range (num_experts={num_experts})")
        if not start <= expert_id < end:
            return  # another expert-parallel rank holds it
        target = p.data[expert_id - start]
        offset = 0 if piece is None else piece * target.shape[0] // 2
        copy_shard(target, loaded, split_dim, rank, world, offset)

    param.weight_loader = loader
    return param


class SparseMoE(nn.Module):
    """Routed experts (stacked) plus shared experts.

    Tensor parallelism splits each routed expert over the TP ranks along its intermediate size: w13
    [E, 2I/tp, H], w2 [E, H, I/tp]. With enable_expert_parallel (at TP > 1) each TP rank instead holds
    E/tp whole experts, the contiguous range `parallel.local_expert_range`: w13 [E/tp, 2I, H], w2
    [E/tp, H, I]. Either way the router is replicated, so every TP rank picks the same experts for the
    same (replicated) tokens and computes its part: a slice of every chosen expert, or the whole of
    the chosen experts it holds (zero for the others). The shared experts stay TP-split. The routed
    and shared partial sums are added first and all-reduced once over the TP group, as in vLLM.

    With every token on every rank the all-reduce is the right combine for expert parallelism too; an
    all-to-all dispatch (each token sent only to the ranks of its experts, then combined back) moves
    less at large EP and across data-parallel ranks, and is not built.
    """

    def __init__(self, config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        experts = config.num_experts
        start, end = parallel.local_expert_range(experts)
        local_inter = inter if parallel.uses_expert_parallel else divide(
            inter, parallel.tensor_parallel_size, "moe_intermediate_size")
        self.config = config
        self.gate_weight = sharded_param((experts, hidden), torch.float32, None, parallel)
        self.e_score_correction_bias = sharded_param((experts,), torch.float32, None, parallel)
        # w13[e] = [w1 (gate); w3 (up)] : [2 * I, hidden]; w2[e] (down) : [hidden, I]
        self.w13 = expert_param((end - start, 2 * local_inter, hidden), dtype, 0, parallel, experts)
        self.w2 = expert_param((end - start, hidden, local_inter), dtype, 1, parallel, experts)
        # global expert id -> index into w13/w2, -1 for another rank's expert (expert parallelism only)
        ids = torch.arange(experts)
        local = torch.where((ids >= start) & (ids < end), ids - start, -1)
        self.expert_map: torch.Tensor | None
        self.register_buffer("expert_map", local if parallel.uses_expert_parallel else None, persistent=False)
        self.shared_experts = (
            DenseMLP(hidden, inter * config.num_shared_experts, parallel, dtype, reduce_results=False)
            if config.num_shared_experts
            else None
        )
        # after loading: the shared expert as routed expert E, chosen by every token (fuse_shared_expert)
        self.shared_fused = False

    def fuse_shared_expert(self) -> None:
        """After loading: a single shared expert (Kimi Linear has one) becomes expert E of the routed
        stack, chosen for every token with weight 1, so the grouped GEMMs compute it with the routed ones
        instead of a separate MLP and add (fewer kernels per decode step). Its TP split is the routed
        experts' (gate and up rows, down columns), so its weights move as they are; the shared MLP's
        parameters become views of them. Not under expert parallelism (routed experts are whole there,
        the shared one is split), nor with several shared experts (their split differs)."""
        shared = self.shared_experts
        if shared is None or self.expert_map is not None or self.config.num_shared_experts != 1:
            return
        self.w13.data = torch.cat([self.w13.data, shared.gate_up_proj.weight.data.unsqueeze(0)])
        self.w2.data = torch.cat([self.w2.data, shared.down_proj.weight.data.unsqueeze(0)])
        shared.gate_up_proj.weight.data = self.w13.data[-1]
        shared.down_proj.weight.data = self.w2.data[-1]
        device = self.w13.device
        self.register_buffer("shared_id", torch.full((1, 1), self.config.num_experts, device=device),
                             persistent=False)
        self.register_buffer("shared_weight", torch.ones(1, 1, device=device), persistent=False)
        self.shared_fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], summed over the TP group (every TP rank runs it)."""
        cfg = self.config
        router_logits = F.linear(x.float(), self.gate_weight)
        weights, ids = grouped_topk(
            router_logits, self.e_score_correction_bias, cfg.num_experts_per_token,
            cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize, cfg.routed_scaling_factor,
        )
        if self.shared_fused:  # the shared expert rides along as expert E, weight 1
            rows = ids.shape[0]
            ids = torch.cat([ids, self.shared_id.expand(rows, 1)], dim=1)
            weights = torch.cat([weights, self.shared_weight.expand(rows, 1)], dim=1)
            return tp_all_reduce(fused_moe(x, self.w13, self.w2, weights, ids, None))
        out = fused_moe(x, self.w13, self.w2, weights, ids, self.expert_map)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out)
