"""Kimi Linear (KimiLinearForCausalLM) built for one pipeline stage and one tensor-parallel rank.

The stage owns a contiguous range of decoder layers; the first stage also owns the embedding and
the last the final norm and lm_head. Token rows are flattened over the step's sequences; per-step
metadata comes from the forward context.

Pipeline stages pass the residual stream on as `IntermediateTensors` (hidden and residual, kept apart
so that the next stage's first norm fuses the add); the caller moves them between ranks
(`deltaserve.distributed.send_tensors` / `recv_tensors`).

Tensor parallelism splits heads and intermediate sizes inside the layers, which all-reduce once per
attention block and once per MLP/MoE block. The embedding and lm_head are replicated on every TP rank:
simple, and `compute_logits` gives full-vocabulary logits on every TP rank with no communication, at
the cost of vocab_size x hidden_size parameters per rank for each (about 2 x 163840 x 2304 x 2 bytes,
1.5 GB, in bfloat16 for Kimi-Linear-48B) where vocab-parallel would hold 1/tp of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.config.model_config import DENSE_MLP, LINEAR_ATTENTION, KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.distributed import get_distributed_state, is_initialized
from deltaserve.model.layers.kda import KimiDeltaAttention
from deltaserve.model.layers.linear import replicated_loader
from deltaserve.model.layers.mla import MultiheadLatentAttention
from deltaserve.model.layers.moe import DenseMLP, SparseMoE
from deltaserve.model.layers.norm import RMSNorm

# checkpoint suffix -> (module-relative parameter name, fused piece index or None)
_KDA_PIECES = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_conv1d.weight": ("self_attn.qkv_conv_weight", 0),
    "self_attn.k_conv1d.weight": ("self_attn.qkv_conv_weight", 1),
    "self_attn.v_conv1d.weight": ("self_attn.qkv_conv_weight", 2),
    "self_attn.o_norm.weight": ("self_attn.o_norm_weight", None),
}
_FUSED_PIECES = {
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 0),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 1),
    "mlp.gate.weight": ("mlp.gate_weight", None),
    "mlp.gate.e_score_correction_bias": ("mlp.e_score_correction_bias", None),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (KDA or MLA) then feed-forward (dense or MoE)."""

    def __init__(self, config: KimiLinearConfig, layer_id: int, parallel: ParallelConfig, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.is_kda = config.layer_types[layer_id] == LINEAR_ATTENTION
        mixer_cls = KimiDeltaAttention if self.is_kda else MultiheadLatentAttention
        self.self_attn = mixer_cls(config, parallel, dtype)
        if config.mlp_layer_types[layer_id] == DENSE_MLP:
            self.mlp: nn.Module = DenseMLP(config.hidden_size, config.intermediate_size, parallel, dtype)
        else:
            self.mlp = SparseMoE(config, parallel, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual): [T, hidden_size] each -> the next layer's (hidden, residual).

        The residual stream is carried beside the sublayer outputs so that each residual add runs
        inside the next norm's kernel: the stream after this layer is residual + hidden. A first
        layer passes residual=None (its input is the stream).
        """
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        normed, residual = self.post_attention_layernorm(self.self_attn(normed), residual)
        return self.mlp(normed), residual


@dataclass
class IntermediateTensors:
    """The residual stream between pipeline stages, [T, hidden_size] each: the stream is hidden + residual;
    with an Eagle3 drafter, also the tap states earlier stages captured, [T, n * hidden_size] in tap order."""

    hidden: torch.Tensor
    residual: torch.Tensor
    taps: torch.Tensor | None = None

    def to_dict(self) -> dict[str, torch.Tensor]:
        out = {"hidden": self.hidden, "residual": self.residual}
        if self.taps is not None:
            out["taps"] = self.taps
        return out

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> IntermediateTensors:
        return cls(tensors["hidden"], tensors["residual"], tensors.get("taps"))


class KimiLinearForCausalLM(nn.Module):
    """The layers of one pipeline stage; `forward` maps token ids (or the previous stage's stream) to
    final hidden states (or this stage's stream), `compute_logits` maps selected rows to vocabulary logits.

    With more than one rank, `deltaserve.distributed.init_distributed` must have run in this process
    with the same grid before the first forward (the layers' all-reduces need the groups); building
    and loading a shard need no groups.
    """

    def __init__(self, config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.parallel, self.dtype = config, parallel, dtype
        self.layer_start, self.layer_end = parallel.stage_layer_range(config.num_hidden_layers)
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype) if parallel.is_first_stage else None
        )
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, i, parallel, dtype) for i in range(self.layer_start, self.layer_end)}
        )
        if parallel.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.requires_grad_(False)
        self._check_groups = parallel.world_size > 1  # until the first forward has found them
        # an Eagle3 drafter's taps: the stream entering each of these layers is captured for every token
        # (earlier stages' relayed with the stream); the last stage leaves them in captured_taps
        self.tap_layer_ids: tuple[int, ...] = ()
        self.captured_taps: torch.Tensor | None = None  # [T, len(tap_layer_ids) * hidden_size]

    def _require_groups(self) -> None:
        parallel = self.parallel
        if not is_initialized() or get_distributed_state().parallel != parallel:
            raise RuntimeError(
                f"a model for tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size} (tensor_parallel_rank={parallel.tensor_parallel_rank}, "
                f"pipeline_parallel_rank={parallel.pipeline_parallel_rank}) needs "
                "deltaserve.distributed.init_distributed(...) with the same sizes and rank before it runs"
            )
        self._check_groups = False

    # Forward ---------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor | None = None, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids: [T] (first stage) or the previous stage's stream (later stages) -> the last
        stage's final-normed hidden states [T, hidden_size], or this stage's stream for the next.

        At one stage this is `model(input_ids) -> [T, hidden_size]`. Positions are not needed: the
        model has no positional encoding (NoPE); the order of tokens lives in the caches.
        """
        if self._check_groups:
            self._require_groups()
        residual: torch.Tensor | None
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("a later pipeline stage needs the previous stage's IntermediateTensors")
            hidden, residual = intermediate.hidden, intermediate.residual
        taps = self._relayed_taps(intermediate)
        for i, layer in self.layers.items():
            if int(i) in self.tap_layer_ids:
                taps.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(hidden, residual)
        joined = torch.cat(taps, dim=-1) if taps else None
        if not self.parallel.is_last_stage:
            return IntermediateTensors(hidden, torch.zeros_like(hidden) if residual is None else residual, joined)
        self.captured_taps = joined
        if residual is None:  # one stage without layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def _relayed_taps(self, intermediate: IntermediateTensors | None) -> list[torch.Tensor]:
        """The taps earlier stages captured, checked against the tap layers they own."""
        expected = sum(i < self.layer_start for i in self.tap_layer_ids) * self.config.hidden_size
        got = 0 if intermediate is None or intermediate.taps is None else intermediate.taps.shape[-1]
        if got != expected:
            raise RuntimeError(f"stage with layers [{self.layer_start}, {self.layer_end}): the previous stage relayed "
                               f"{got} tap columns, but taps {self.tap_layer_ids} below layer {self.layer_start} "
                               f"make {expected}")
        return [intermediate.taps] if got else []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> float32 logits [N, vocab_size] (last stage; full vocabulary on
        every TP rank, the lm_head being replicated)."""
        return self.lm_head(hidden).float()

    # Caches ----------------------------------------------------------------------------------
    def kda_layers(self) -> list[KimiDeltaAttention]:
        return [layer.self_attn for layer in self.layers.values() if layer.is_kda]

    def mla_layers(self) -> list[MultiheadLatentAttention]:
        return [layer.self_attn for layer in self.layers.values() if not layer.is_kda]

    # Weights ---------------------------------------------------------------------------------
    def fuse_after_loading(self) -> None:
        """After loading: each attention layer's input projections as one GEMM (KDA's four, MLA's two),
        and each MoE layer's shared expert inside its routed experts' grouped GEMMs."""
        for layer in [*self.kda_layers(), *self.mla_layers()]:
            layer.fuse_input_projections()
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.fuse_shared_expert()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (hub layout) into this stage's parameters.

        Returns the checkpoint names consumed. Tensors of layers that belong to other pipeline stages
        are skipped; so are (inside the experts' loader, still counted as consumed) routed experts that
        another expert-parallel rank holds. A name that maps to no parameter raises ValueError naming it.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._route(name)
            if target is None:
                continue
            param_name, shard_id, expert = target
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model (unexpected)")
            param = params[param_name]
            if tensor.dim() == 3 and param_name.endswith("qkv_conv_weight"):
                tensor = tensor.squeeze(1)  # hub conv weights are [D, 1, W]
            tensor = tensor.to(param.dtype)
            try:
                if expert is None:
                    getattr(param, "weight_loader", replicated_loader)(param, tensor, shard_id)
                else:  # SparseMoE's expert loader: this rank's slice, or nothing for another EP rank's expert
                    param.weight_loader(param, tensor, shard_id, expert)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            loaded.add(name)
        return loaded

    def _route(self, name: str) -> tuple[str, int | None, int | None] | None:
        """Checkpoint name -> (parameter name, fused piece, expert index), or None for another stage."""
        if name == "model.embed_tokens.weight":
            if self.parallel.is_first_stage:
                return "embed_tokens.weight", None, None
            # tied weights on a last stage that does not hold the embedding: its lm_head is a copy
            tied_here = self.config.tie_word_embeddings and self.parallel.is_last_stage
            return ("lm_head.weight", None, None) if tied_here else None
        if name in ("model.norm.weight", "lm_head.weight"):
            local = name.removeprefix("model.")
            return (local, None, None) if self.parallel.is_last_stage else None
        match = _LAYER_NAME.match(name)
        if match is None:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to this model (unexpected)")
        layer_id, rest = int(match.group(1)), match.group(2)
        if layer_id >= self.config.num_hidden_layers:
            raise ValueError(f"checkpoint tensor {name!r} names layer {layer_id}, but the model has "
                             f"{self.config.num_hidden_layers} layers (unexpected)")
        if not self.layer_start <= layer_id < self.layer_end:
            return None
        rest = rest.replace("block_sparse_moe.", "mlp.", 1)
        prefix = f"layers.{layer_id}."
        expert = _EXPERT_NAME.match(rest)
        if expert is not None:
            piece = {"w1": 0, "w3": 1, "w2": None}[expert.group(2)]
            param = "mlp.w2" if piece is None else "mlp.w13"
            return prefix + param, piece, int(expert.group(1))
        pieces = _KDA_PIECES if layer_id in self.config.kda_layer_ids else {}
        if rest in pieces or rest in _FUSED_PIECES:
            param, piece = pieces.get(rest) or _FUSED_PIECES[rest]
            return prefix + param, piece, None
        return prefix + rest, None, None
