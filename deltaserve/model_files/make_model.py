"""Random-weight checkpoints of a preset: on disk (`make_model`) or in memory (`build_random_state_dict`)."""

from __future__ import annotations

import dataclasses
import os

import torch

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.model_files.checkpoint_io import DEFAULT_MAX_SHARD_BYTES, write_checkpoint
from deltaserve.model_files.presets import preset_config
from deltaserve.model_files.random_weights import iter_random_weights, resolve_dtype
from deltaserve.model_files.tokenizer import BOS, EOS, PAD, build_byte_tokenizer

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def build_random_state_dict(
    config: KimiLinearConfig,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Hub-layout name -> random tensor on `device` (see random_weights for the init and determinism)."""
    return dict(iter_random_weights(config, seed, dtype, device))


def tokenizer_for(config: KimiLinearConfig):
    """The byte tokenizer whose bos / eos / pad sit at the config's ids."""
    ids = {BOS: config.bos_token_id, EOS: config.eos_token_id[0] if config.eos_token_id else None,
           PAD: config.pad_token_id}
    return build_byte_tokenizer(
        config.vocab_size,
        special_token_ids={t: i for t, i in ids.items() if i is not None},
        model_max_length=config.max_position_embeddings,
    )


def make_model(
    preset: str,
    out_dir: str,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write `preset` with random weights (config, safetensors, byte tokenizer) to out_dir; returns its path.

    dtype: None or 'auto' keeps the preset's torch_dtype; otherwise float32, float16 or bfloat16.
    """
    config = preset_config(preset)
    if dtype not in (None, "auto"):
        config = dataclasses.replace(config, torch_dtype=_DTYPE_NAMES[resolve_dtype(dtype, config)])
    write_checkpoint(out_dir, config, iter_random_weights(config, seed, None, "cpu"), max_shard_bytes)
    tokenizer_for(config).save_pretrained(out_dir)
    return os.path.abspath(out_dir)
