"""Token streams on disk, a resumable deterministic batch sampler, and held-out windows.

Training windows: epoch e cuts the train stream into windows of seq_len + 1 tokens starting at a
random offset in [0, seq_len) (so window borders move between epochs), shuffles them with a
generator seeded by (seed, e), and hands them out batch_size at a time; the remainder that does not
fill a batch is dropped. The sampler's whole state is (epoch, cursor), saved in every checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


def load_tokens(data_dir: str, split: str) -> np.ndarray:
    """The split's token ids as a read-only uint16 memmap: [N]."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        raise ValueError(f"data: {path} is missing; run `python -m tools.train_tiny prepare --out {data_dir}`")
    return np.memmap(path, dtype=np.uint16, mode="r")


@dataclass
class SamplerState:
    epoch: int = 0
    cursor: int = 0  # windows of this epoch already handed out


class BatchSampler:
    """Deterministic, resumable batches of [batch_size, seq_len] inputs and next-token targets."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        if tokens.size < batch_size * (seq_len + 1) + seq_len:
            raise ValueError(
                f"data: {tokens.size} tokens cannot fill one batch of batch_size={batch_size} x "
                f"seq_len={seq_len}; lower them or prepare more data"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.state = SamplerState()
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def windows_per_epoch(self) -> int:
        """A lower bound over epochs (the offset costs at most one window)."""
        return (self.tokens.size - self.seq_len) // (self.seq_len + 1)

    def batches_per_epoch(self) -> int:
        return self.windows_per_epoch() // self.batch_size

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(0, self.seq_len))
            starts = offset + (self.seq_len + 1) * np.arange(self.windows_per_epoch(), dtype=np.int64)
            self._epoch_cache = (epoch, starts[rng.permutation(starts.size)])
        return self._epoch_cache[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch_size, seq_len] int64; targets are inputs shifted by one."""
        starts = self._epoch_starts(self.state.epoch)
        if self.state.cursor + self.batch_size > starts.size:
            self.state = SamplerState(self.state.epoch + 1, 0)
            starts = self._epoch_starts(self.state.epoch)
        picked = starts[self.state.cursor : self.state.cursor + self.batch_size]
        self.state.cursor += self.batch_size
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in picked])
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "cursor": self.state.cursor}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.state = SamplerState(int(d["epoch"]), int(d["cursor"]))


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, max_windows: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive windows over the held-out stream, each token predicted once (stride seq_len).

    Yields (inputs, targets) [b, seq_len] int64; the last window may be shorter and is yielded alone.
    """
    n = tokens.size - 1
    starts = list(range(0, n, seq_len))
    if max_windows is not None:
        starts = starts[:max_windows]
    full = [s for s in starts if s + seq_len <= n]
    for i in range(0, len(full), batch_size):
        rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in full[i : i + batch_size]])
        batch = torch.from_numpy(rows)
        yield batch[:, :-1], batch[:, 1:]
    tail = [s for s in starts if s + seq_len > n]
    for s in tail:
        row = torch.from_numpy(np.asarray(tokens[s : n + 1], dtype=np.int64))[None]
        if row.shape[1] > 1:
            yield row[:, :-1], row[:, 1:]


def split_documents(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """The stream cut at every eos_id (the eos itself dropped); empty documents are skipped."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_id)
    docs, start = [], 0
    for end in ends:
        if end > start:
            docs.append(np.asarray(tokens[start:end]))
        start = end + 1
    return docs
