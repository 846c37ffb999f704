"""`--model random:<preset>`: a preset with random weights built straight into device memory.

Nothing is written to disk, so the 48B shape (about 96 GB in bfloat16) can be served or benchmarked
on one GPU. The weights are the ones `make-model --preset <preset> --seed <seed>` would write
(random_weights draws each tensor from its own seeded generator), and the tokenizer is the same
byte tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model_files.presets import preset_config

RANDOM_PREFIX = "random:"


def random_preset_name(model: str | None) -> str | None:
    """"random:small" -> "small"; anything else -> None."""
    if model is None or not model.startswith(RANDOM_PREFIX):
        return None
    name = model[len(RANDOM_PREFIX):]
    preset_config(name)  # an unknown preset is a ValueError naming it
    return name


def random_model_config(model: str) -> KimiLinearConfig:
    name = random_preset_name(model)
    if name is None:
        raise ValueError(f"model={model!r} is not of the form {RANDOM_PREFIX}<preset>")
    return preset_config(name)


def random_model_tokenizer(config: KimiLinearConfig) -> Any:
    from deltaserve.model_files.make_model import tokenizer_for

    return tokenizer_for(config)


def build_random_model(config: KimiLinearConfig, parallel: ParallelConfig, dtype: torch.dtype,
                       device: torch.device, seed: int = 0) -> Any:
    """A KimiLinearForCausalLM of `config` on `device` with the seeded random weights of make-model."""
    from deltaserve.model.loader import load_model
    from deltaserve.model_files.random_weights import iter_random_weights

    return load_model(config, parallel, dtype, device, iter_random_weights(config, seed, dtype, device))
