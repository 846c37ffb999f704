"""The Kimi Linear architecture, read from a checkpoint's config.json.

Two spellings of the same config exist in the wild: the one Moonshot published on the hub
(`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`, `num_experts`,
`first_k_dense_replace`, ...) and the one `transformers` writes (`layer_types`, `mlp_layer_types`,
`num_local_experts`, `linear_num_heads`, ...). Both are read into one frozen dataclass here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
DENSE_MLP = "dense"
SPARSE_MLP = "sparse"


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in d and d[name] is not None:
            return d[name]
    return default


@dataclass(frozen=True)
class KimiLinearConfig:
    """Every architectural number the engine needs, with names as in the hub config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    linear_num_heads: int
    linear_head_dim: int
    short_conv_kernel_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config: layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
                raise ValueError(f"config: layer {i} has unknown layer type {kind!r}")
        for i, kind in enumerate(self.mlp_layer_types):
            if kind not in (DENSE_MLP, SPARSE_MLP):
                raise ValueError(f"config: layer {i} has unknown mlp layer type {kind!r}")
        if self.num_experts % self.num_expert_group:
            raise ValueError(
                f"config: num_experts={self.num_experts} is not divisible by "
                f"num_expert_group={self.num_expert_group}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"config: hidden_act={self.hidden_act!r} is not supported (only 'silu')")

    # Derived sizes ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: the compressed latent plus the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def kda_qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    # Reading and writing ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KimiLinearConfig:
        model_type = d.get("model_type", "kimi_linear")
        if model_type != "kimi_linear":
            raise ValueError(f"config: model_type={model_type!r} is not supported (expected 'kimi_linear')")
        lac = d.get("linear_attn_config") or {}
        num_layers = int(d["num_hidden_layers"])

        layer_types = d.get("layer_types")
        if layer_types is None:
            if "kda_layers" in lac and "full_attn_layers" in lac:
                types: list[str | None] = [None] * num_layers
                for one_based in lac["full_attn_layers"]:
                    types[one_based - 1] = FULL_ATTENTION
                for one_based in lac["kda_layers"]:
                    types[one_based - 1] = LINEAR_ATTENTION
                missing = [i for i, t in enumerate(types) if t is None]
                if missing:
                    raise ValueError(f"config: layers {missing} are in neither kda_layers nor full_attn_layers")
                layer_types = types
            else:
                layer_types = [
                    FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(num_layers)
                ]

        mlp_layer_types = d.get("mlp_layer_types")
        if mlp_layer_types is None:
            first_dense = int(d.get("first_k_dense_replace", 1))
            freq = int(d.get("moe_layer_freq", 1))
            mlp_layer_types = [
                SPARSE_MLP if i >= first_dense and i % freq == 0 else DENSE_MLP for i in range(num_layers)
            ]

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(d["num_attention_heads"])
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(_first(d, "moe_intermediate_size", default=d["intermediate_size"])),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            kv_lora_rank=int(d["kv_lora_rank"]),
            q_lora_rank=d.get("q_lora_rank"),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(_first(d, "v_head_dim", default=d["qk_nope_head_dim"])),
            num_experts=int(_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=0)),
            num_experts_per_token=int(
                _first(d, "num_experts_per_token", "num_experts_per_tok", default=1)
            ),
            num_shared_experts=int(_first(d, "num_shared_experts", "n_shared_experts", default=0)),
            num_expert_group=int(_first(d, "num_expert_group", "n_group", default=1)),
            topk_group=int(_first(d, "topk_group", default=1)),
            moe_renormalize=bool(_first(d, "moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(_first(d, "routed_scaling_factor", default=1.0)),
            linear_num_heads=int(_first(lac, "num_heads", default=_first(d, "linear_num_heads", default=32))),
            linear_head_dim=int(_first(lac, "head_dim", default=_first(d, "linear_head_dim", default=128))),
            short_conv_kernel_size=int(
                _first(lac, "short_conv_kernel_size", default=_first(d, "linear_conv_kernel_dim", default=4))
            ),
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_layer_types),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=int(
                _first(d, "model_max_length", "max_position_embeddings", default=1048576)
            ),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=str(_first(d, "torch_dtype", "dtype", default="bfloat16")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> KimiLinearConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model: no config.json in {model_dir!r}; is this a checkpoint directory?")
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"model: {path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    def to_hub_dict(self) -> dict[str, Any]:
        """The config.json as published on the hub (1-based layer lists in `linear_attn_config`)."""
        first_dense = 0
        while first_dense < self.num_hidden_layers and self.mlp_layer_types[first_dense] == DENSE_MLP:
            first_dense += 1
        d: dict[str, Any] = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "use_grouped_topk": True,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": first_dense,
            "moe_layer_freq": 1,
            "linear_attn_config": {
                "head_dim": self.linear_head_dim,
                "num_heads": self.linear_num_heads,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "kda_layers": [i + 1 for i in self.kda_layer_ids],
                "full_attn_layers": [i + 1 for i in self.mla_layer_ids],
            },
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "model_max_length": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id,
        }
        if any(t == DENSE_MLP for t in self.mlp_layer_types[first_dense:]):
            d["mlp_layer_types"] = list(self.mlp_layer_types)
        return d

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d
