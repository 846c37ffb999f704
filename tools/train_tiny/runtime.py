"""Device, precision, seeding and RNG state for the training commands."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch


def pick_device(name: str | None) -> torch.device:
    """`name` ("cpu", "cuda", "cuda:1"), or CUDA when present, else the CPU."""
    if name:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={name!r} asked for CUDA, which this machine does not have; use --device cpu")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def configure_cpu_threads(device: torch.device, threads: int | None) -> None:
    """On the CPU use `threads` (default 1) threads.

    A busy shared machine makes OpenMP's spinning threads wait on each other: on this 2-core box a
    micro step took 4 s with 2 threads and 0.1 s with 1.
    """
    if device.type == "cpu":
        torch.set_num_threads(threads or 1)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when precision == "bf16" (weights stay float32); otherwise nothing."""
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision={precision!r} is not supported; choose bf16 or fp32")
    if precision == "bf16" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) generator states, for a checkpoint."""
    state: dict[str, Any] = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def persist_fla_autotune(run_dir: str) -> None:
    """Let fla read kernel configs tuned by earlier commands of this run from <run_dir>/fla_tuned.

    fla autotunes every Triton kernel on first use (forward and backward), which can take minutes on
    a fresh process; `save_fla_autotune` writes what was chosen, and the next command (a resumed
    stage, or the next stage on the same machine) reads it back. Must run before fla is imported.
    """
    import os

    if torch.cuda.is_available() and "FLA_CONFIG_DIR" not in os.environ:  # fla's kernels run on GPUs only
        os.environ["FLA_CONFIG_DIR"] = os.path.join(run_dir, "fla_tuned")
        os.environ.setdefault("FLA_CACHE_MODE", "strict")


def save_fla_autotune(run_dir: str) -> int:
    """Write the fla configs chosen in this process into <run_dir>/fla_tuned; entries written (0 without fla)."""
    import os
    import sys

    if "fla" not in sys.modules:
        return 0
    from deltaserve.ops.kda.fla_tuning import dump_autotune_results

    try:
        return dump_autotune_results(os.environ.get("FLA_CONFIG_DIR") or os.path.join(run_dir, "fla_tuned"))
    except ImportError:  # a stand-in module blocks fla (the CPU tests do)
        return 0
