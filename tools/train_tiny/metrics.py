"""Held-out loss, bits per byte, the unigram baseline and top-1 agreement between two models."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tools.train_tiny.data import eval_batches
from tools.train_tiny.runtime import autocast


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int, device: torch.device,
    precision: str = "bf16", max_windows: int | None = None,
) -> tuple[float, int]:
    """(mean nats per predicted token, number of predicted tokens) over the held-out stream [N]."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for x, y in eval_batches(tokens, seq_len, batch_size, max_windows):
        x, y = x.to(device), y.to(device)
        with autocast(device, precision):
            logits = model(input_ids=x).logits
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        count += y.numel()
    model.train(was_training)
    return float(total) / max(count, 1), count


@torch.no_grad()
def top1_agreement(
    model: torch.nn.Module, reference: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int,
    device: torch.device, precision: str = "bf16", max_windows: int | None = None,
) -> float:
    """Fraction of held-out positions where argmax(model) == argmax(reference): a draft's greedy
    acceptance rate per token against the target, under teacher forcing."""
    agree = count = 0
    for x, _ in eval_batches(tokens, seq_len, batch_size, max_windows):
        x = x.to(device)
        with autocast(device, precision):
            a = model(input_ids=x).logits.argmax(-1)
            b = reference(input_ids=x).logits.argmax(-1)
        agree += int((a == b).sum())
        count += a.numel()
    return agree / max(count, 1)


def unigram_loss(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Nats per token on val of the add-one-smoothed unigram distribution of train (tokens 1..N-1 of val,
    the ones the models predict)."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val_tokens[1:], dtype=np.int64)].mean())


def bits_per_byte(nats_per_token: float, num_tokens: int, num_bytes: int) -> float:
    """Nats per token turned into bits per UTF-8 byte of the same text."""
    return nats_per_token * num_tokens / (num_bytes * math.log(2))
