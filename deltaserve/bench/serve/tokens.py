"""Synthetic lengths and token ids: pure functions of a key, ids drawn uniformly from the vocabulary.

Every synthetic piece of a workload (a random prompt, a shared prefix, a trace block, a session's
tool results) comes from a generator keyed by its `Namespace` and what it is (kind, index...):
  - lengths depend on (seed, level) only, so the requests of a run, and their token totals, are fixed
    by --seed;
  - token ids depend also on the run's salt: a fresh one per run by default, so a rerun against a
    warm server is not served from the cache the last run left (pass --salt to repeat the ids).
The level is the concurrency level's index: each level draws fresh prompts, so the server's cache
from an earlier level cannot serve a later one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the `kind` part of a key: what is drawn
RANDOM_PROMPT = 1
RANDOM_PREFIX = 2
TRACE_BLOCK = 3
SYSTEM_PROMPT = 4
TOOL_DEFINITIONS = 5
SESSION = 6
SESSION_ANSWER = 7

_LENGTHS, _TOKENS = 0, 1  # keeps the two key spaces apart


def random_tokens(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    """n token ids in [0, vocab_size) from `rng`."""
    return rng.integers(0, vocab_size, n).tolist()


@dataclass(frozen=True)
class Namespace:
    """The keys of one level of one run: seed and level (lengths), plus salt (token ids); all >= 0."""

    seed: int
    salt: int
    level: int

    def length_rng(self, kind: int, *index: int) -> np.random.Generator:
        """A generator for lengths (and think times), a pure function of (seed, level, kind, index)."""
        return np.random.default_rng([_LENGTHS, self.seed, self.level, kind, *index])

    def token_rng(self, kind: int, *index: int) -> np.random.Generator:
        """A generator for token ids, a pure function of (seed, salt, level, kind, index)."""
        return np.random.default_rng([_TOKENS, self.seed, self.salt, self.level, kind, *index])

    def tokens(self, vocab_size: int, n: int, kind: int, *index: int) -> list[int]:
        """n token ids in [0, vocab_size) keyed by (kind, index)."""
        return random_tokens(self.token_rng(kind, *index), vocab_size, n)
