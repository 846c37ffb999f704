"""Builds the model of one pipeline stage and fills it from a checkpoint or from random weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.model_files.checkpoint_io import iter_checkpoint_tensors
from deltaserve.model_files.hub_layout import hub_tensor_shapes

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, config: KimiLinearConfig) -> torch.dtype:
    """'auto' follows the checkpoint's torch_dtype; otherwise the named dtype."""
    name = config.torch_dtype if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose float32, float16 or bfloat16")
    return _DTYPES[name]


def _canonical(name: str) -> str:
    # a dense layer's MLP may be stored under block_sparse_moe.* (as save_pretrained writes it) or mlp.*
    return name.replace(".block_sparse_moe.", ".mlp.")


def expected_tensor_names(config: KimiLinearConfig, parallel: ParallelConfig) -> set[str]:
    """Checkpoint names (canonical spelling) this stage must find."""
    start, end = parallel.stage_layer_range(config.num_hidden_layers)
    names = set()
    for name in hub_tensor_shapes(config):
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if not start <= layer < end:
                continue
        elif name == "model.embed_tokens.weight" and not parallel.is_first_stage:
            if not (config.tie_word_embeddings and parallel.is_last_stage):  # a tied lm_head copies it
                continue
        elif name in ("model.norm.weight", "lm_head.weight") and not parallel.is_last_stage:
            continue
        names.add(_canonical(name))
    return names


def load_model(
    config: KimiLinearConfig,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights: Iterable[tuple[str, torch.Tensor]],
) -> KimiLinearForCausalLM:
    """Allocate the stage's parameters on `device` and copy `weights` (hub names) into them.

    A tensor the model does not have, or one the model needs but the checkpoint lacks, is a
    ValueError that names it.
    """
    with torch.device(device):
        model = KimiLinearForCausalLM(config, parallel, dtype)
    loaded = {_canonical(n) for n in model.load_weights(weights)}
    if config.tie_word_embeddings and parallel.is_last_stage:
        # a last stage without the embedding loaded lm_head from model.embed_tokens.weight instead
        if parallel.is_first_stage:
            model.lm_head.weight = model.embed_tokens.weight
            loaded.add("lm_head.weight")
    missing = sorted(expected_tensor_names(config, parallel) - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
    model.fuse_after_loading()
    return model.eval()


def load_model_from_dir(
    model_dir: str, config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype, device: torch.device
) -> KimiLinearForCausalLM:
    """Load a safetensors checkpoint (single file or sharded) in the hub layout."""
    return load_model(config, parallel, dtype, device, iter_checkpoint_tensors(model_dir, device="cpu"))
