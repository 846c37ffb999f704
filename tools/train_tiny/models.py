"""The model shapes (target, draft, micro) and building them with transformers' KimiLinear classes.

Every shape is a hub-style config.json dict as deltaserve writes it (`KimiLinearConfig.to_hub_dict`),
so deltaserve's parser is checked on each one before transformers sees it.

Why these sizes (vocabulary 4096, the trained BPE): the corpus has about 2.7M training tokens, so
an 11M-parameter target already sees each token several times in its few GPU minutes; more width
would only memorise. The target keeps the published model's structure at 1/9 the width: a dense
first layer, a 3:1 KDA:MLA pattern (MLA at layers 4 and 8 of 8, 1-based), MoE with a shared expert,
sigmoid routing with a correction bias, top-2 of 8 experts. Head sizes are 64, which fla's kernels
and PyTorch's flash attention take as they are (MLA qk = 48 nope + 16 rope = v = 64).
"""

from __future__ import annotations

import sys
from typing import Any

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.model_files.presets import ParameterCount, count_parameters


def kimi_hub_config(
    *, vocab_size: int, hidden_size: int, num_hidden_layers: int, full_attn_layers: list[int],
    linear_num_heads: int, linear_head_dim: int, num_attention_heads: int, qk_nope_head_dim: int,
    qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int, intermediate_size: int,
    moe_intermediate_size: int, num_experts: int, num_experts_per_token: int,
    bos_token_id: int = 0, eos_token_id: int = 1, pad_token_id: int = 2, model_max_length: int = 8192,
) -> dict[str, Any]:
    """A hub config.json dict; `full_attn_layers` are 1-based, every other layer is KDA, layer 0 is dense."""
    kda_layers = [i for i in range(1, num_hidden_layers + 1) if i not in full_attn_layers]
    d = dict(
        model_type="kimi_linear", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        kv_lora_rank=kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        num_experts=num_experts, num_experts_per_token=num_experts_per_token, num_shared_experts=1,
        num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446,
        first_k_dense_replace=1, hidden_act="silu",
        linear_attn_config=dict(
            head_dim=linear_head_dim, num_heads=linear_num_heads, short_conv_kernel_size=4,
            kda_layers=kda_layers, full_attn_layers=full_attn_layers,
        ),
        rms_norm_eps=1e-5, model_max_length=model_max_length, tie_word_embeddings=False,
        torch_dtype="bfloat16", bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    return KimiLinearConfig.from_dict(d).to_hub_dict()


def target_config(vocab_size: int = 4096, **specials: int) -> dict[str, Any]:
    """11.3M parameters, 6.2M of them used per token (the embedding table aside): 8 layers of width 256."""
    return kimi_hub_config(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=8, full_attn_layers=[4, 8],
        linear_num_heads=4, linear_head_dim=64,
        num_attention_heads=4, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, kv_lora_rank=128,
        intermediate_size=768, moe_intermediate_size=128, num_experts=8, num_experts_per_token=2, **specials,
    )


def draft_config(vocab_size: int = 4096, **specials: int) -> dict[str, Any]:
    """2.1M parameters, half of them the embedding and head: 4 layers of width 128 [KDA KDA KDA MLA]."""
    return kimi_hub_config(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, full_attn_layers=[4],
        linear_num_heads=2, linear_head_dim=64,
        num_attention_heads=2, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, kv_lora_rank=64,
        intermediate_size=384, moe_intermediate_size=96, num_experts=4, num_experts_per_token=2, **specials,
    )


def micro_config(vocab_size: int = 512, **specials: int) -> dict[str, Any]:
    """A few hundred thousand parameters for CPU proofs: 3 layers of width 64 [KDA KDA MLA]."""
    return kimi_hub_config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, full_attn_layers=[3],
        linear_num_heads=2, linear_head_dim=32,
        num_attention_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=32,
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
        model_max_length=2048, **specials,
    )


SHAPES = {"target": target_config, "draft": draft_config, "micro": micro_config}


def shape_config(name: str, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> dict:
    """The named shape for a tokenizer's vocabulary and special ids; an unknown name is a ValueError."""
    if name not in SHAPES:
        raise ValueError(f"model={name!r} is not a known shape; choose one of {', '.join(SHAPES)}")
    return SHAPES[name](
        vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id
    )


def parameter_count(hub_config: dict[str, Any]) -> ParameterCount:
    """(total, active per token) as deltaserve counts them (active excludes the embedding table)."""
    return count_parameters(KimiLinearConfig.from_dict(hub_config))


def block_fla_without_cuda() -> None:
    """On a machine without CUDA make `import fla` fail, so transformers takes its PyTorch KDA path.

    transformers binds fla's Triton kernels when its kimi_linear module is imported, whenever fla
    imports, and those kernels fail on CPU tensors. Call before importing the model classes.
    """
    import torch

    if not torch.cuda.is_available() and "fla" not in sys.modules:
        sys.modules["fla"] = None  # type: ignore[assignment]


def build_model(hub_config: dict[str, Any], seed: int, experts_implementation: str | None = None) -> Any:
    """A freshly initialised float32 `transformers.KimiLinearForCausalLM` (HF's own init, seeded).

    experts_implementation: transformers' MoE kernel ("eager", "grouped_mm", ...); None keeps its default.
    """
    import torch

    block_fla_without_cuda()
    from transformers import KimiLinearConfig as HFConfig
    from transformers import KimiLinearForCausalLM

    ours = KimiLinearConfig.from_dict(hub_config)
    kwargs = {k: v for k, v in ours.to_hub_dict().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(HFConfig(**kwargs)).float()
    if experts_implementation is not None and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_implementation)
    return model


def settle_experts_implementation(
    model: Any, device: Any, precision: str, backward: bool, requested: str | None = None
) -> str:
    """Run one tiny forward (and backward) pass; on CUDA fall back to "eager" experts if the default fails.

    transformers' default MoE path ("grouped_mm") casts the activations to the weights' dtype, so under
    bf16 autocast with float32 master weights it needs a float32 grouped GEMM; where a torch build
    lacks one, the per-expert loop ("eager") is always available. An explicit `requested` is kept.
    Returns the implementation in use.
    """
    import torch

    from tools.train_tiny.runtime import autocast

    def probe() -> None:
        x = torch.randint(3, model.config.vocab_size, (1, 16), device=device)
        with torch.enable_grad() if backward else torch.no_grad():
            with autocast(device, precision):
                logits = model(input_ids=x).logits
            if backward:
                logits.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    current = getattr(model.config, "_experts_implementation", None) or "eager"
    try:
        probe()
    except Exception as e:
        if requested is not None or device.type != "cuda" or current == "eager":
            raise
        print(f"[models] experts_implementation={current!r} failed ({type(e).__name__}: {e}); using 'eager'",
              flush=True)
        model.set_experts_implementation("eager")
        current = "eager"
        probe()
    return current


def load_model(model_dir: str, experts_implementation: str | None = None) -> Any:
    """A saved checkpoint as a float32 `transformers.KimiLinearForCausalLM` in eval mode."""
    import torch

    block_fla_without_cuda()
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if experts_implementation is not None and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_implementation)
    return model.eval()
