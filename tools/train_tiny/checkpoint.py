"""Training checkpoints (resume) and the final export (`save_pretrained`, bf16, small shards).

A run directory holds
- ckpt/state.pt: model and optimizer state, step, sampler position, RNG states, the fixed step
  budget, the best held-out loss and the loss history; written atomically (tmp file + rename);
- ckpt/best.pt: the model state of the best held-out loss so far (exported by default);
- loss_curve.csv / loss_curve.json: the history, rewritten at every log line.
"""

from __future__ import annotations

import copy
import csv
import json
import os
from typing import Any

import torch

from tools.train_tiny import bpe

STATE_FILE = "state.pt"
BEST_FILE = "best.pt"
DEFAULT_MAX_SHARD_SIZE = "15MB"  # under 16 MiB: the device returns files of at most 16 MiB
KEEP_FP32 = ("e_score_correction_bias", "gate.weight", "dt_bias")  # transformers' _keep_in_fp32_modules_strict


def _atomic_save(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_state(run_dir: str, state: dict[str, Any]) -> str:
    """Write run_dir/ckpt/state.pt; returns its path."""
    path = os.path.join(run_dir, "ckpt", STATE_FILE)
    _atomic_save(state, path)
    return path


def load_state(run_dir: str) -> dict[str, Any]:
    """run_dir/ckpt/state.pt; a missing one is a ValueError naming the path."""
    path = os.path.join(run_dir, "ckpt", STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"resume: no checkpoint at {path}; is {run_dir!r} a run directory?")
    return torch.load(path, map_location="cpu", weights_only=False)


def has_state(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, "ckpt", STATE_FILE))


def save_best(run_dir: str, model_state: dict[str, torch.Tensor], step: int, val_loss: float) -> None:
    _atomic_save({"model": model_state, "step": step, "val_loss": val_loss}, os.path.join(run_dir, "ckpt", BEST_FILE))


def load_best(run_dir: str) -> dict[str, Any] | None:
    path = os.path.join(run_dir, "ckpt", BEST_FILE)
    return torch.load(path, map_location="cpu", weights_only=False) if os.path.isfile(path) else None


def write_history(run_dir: str, history: list[dict[str, Any]]) -> None:
    """loss_curve.json (the list) and loss_curve.csv (one row per entry, union of the keys)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "loss_curve.json"), "w") as f:
        json.dump(history, f, indent=1)
        f.write("\n")
    keys: list[str] = []
    for row in history:
        keys.extend(k for k in row if k not in keys)
    with open(os.path.join(run_dir, "loss_curve.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)


def export_pretrained(
    model: torch.nn.Module,
    out_dir: str,
    tokenizer_dir: str,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """`save_pretrained` a copy of `model` in `dtype` (router and dt_bias kept float32) with the tokenizer.

    Writes config.json, generation_config.json, safetensors shards under `max_shard_size` and the
    tokenizer files; returns the directory's file names.
    """
    out = copy.deepcopy(model).to("cpu")
    out.to(dtype)
    for name, p in list(out.named_parameters()) + list(out.named_buffers()):
        if any(k in name for k in KEEP_FP32) and p.is_floating_point():
            p.data = p.data.float()
    out.config.dtype = dtype
    gen = out.generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(gen, key, getattr(out.config, key))
    os.makedirs(out_dir, exist_ok=True)
    out.save_pretrained(out_dir, max_shard_size=max_shard_size)
    bpe.copy_tokenizer_files(tokenizer_dir, out_dir)
    return sorted(os.listdir(out_dir))
