"""Random weights in the hub layout, initialised so that a random model still produces varied text.

Determinism: every tensor is drawn on the CPU, in float32, from its own `torch.Generator` seeded
from (seed, tensor name) with blake2b, then cast and moved to the target device. The values are
therefore bit-identical whatever the device, the dtype cast aside, and whichever subset or order of
tensors is asked for. Drawing runs on a few CPU threads ahead of the consumer, so building the 48B
model straight into GPU memory is bound by the CPU's random number generation (about 0.1 G
values/s per core), not by Python.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.model_files.hub_layout import FLOAT32, hub_tensor_shapes

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONV_STD = 0.2
ROUTER_BIAS_STD = 0.01


def resolve_dtype(dtype: torch.dtype | str | None, config: KimiLinearConfig) -> torch.dtype:
    """None (or 'auto') means the config's torch_dtype; a string names float32, float16 or bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype in (None, "auto") else dtype
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: a 63-bit hash of (seed, name), stable across processes."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw(name: str, shape: tuple[int, ...], config: KimiLinearConfig, gen: torch.Generator) -> torch.Tensor:
    """float32 values on the CPU; norms are ones, the rest follows fla / transformers' init."""
    std = float(config.extra.get("initializer_range", 0.02))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".A_log"):  # per-head decay rate A in [1, 16]
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith(".dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_()
        dt = dt.clamp_min_(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith(".e_score_correction_bias"):  # nonzero so that tests exercise it
        return torch.empty(shape).normal_(0.0, ROUTER_BIAS_STD, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.empty(shape).normal_(0.0, CONV_STD, generator=gen)
    if name.endswith(".weight") and len(shape) == 2:  # linear layers, embeddings and the router
        return torch.empty(shape).normal_(0.0, std, generator=gen)
    raise ValueError(f"random weights: no initialisation rule for tensor {name!r} of shape {shape}")


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    kind: str,
    config: KimiLinearConfig,
    generator: torch.Generator,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One tensor of the hub layout, drawn from the CPU `generator`.

    kind is hub_layout's MODEL_DTYPE (cast to `dtype`) or FLOAT32 (kept in float32).
    """
    values = _draw(name, tuple(shape), config, generator)
    return values.to(device=device, dtype=torch.float32 if kind == FLOAT32 else dtype)


def _cpu_tensor(name: str, shape: tuple[int, ...], kind: str, config: KimiLinearConfig, seed: int,
                dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    return random_tensor(name, shape, kind, config, gen, dtype, "cpu")


def iter_random_weights(
    config: KimiLinearConfig,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    num_threads: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `hub_tensor_shapes(config)`, in that order.

    dtype: None follows config.torch_dtype; FLOAT32 tensors stay float32 regardless.
    """
    model_dtype = resolve_dtype(dtype, config)
    items = list(hub_tensor_shapes(config).items())
    workers = num_threads or max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="random-weights") as pool:
        pending: deque[tuple[str, Future[torch.Tensor]]] = deque()
        next_item = 0
        while next_item < len(items) or pending:
            while next_item < len(items) and len(pending) < 2 * workers:
                name, (shape, kind) = items[next_item]
                pending.append((name, pool.submit(_cpu_tensor, name, shape, kind, config, seed, model_dtype)))
                next_item += 1
            name, future = pending.popleft()
            yield name, future.result().to(device)
