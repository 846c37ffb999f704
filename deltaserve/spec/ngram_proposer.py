"""The n-gram drafter (prompt lookup, vLLM's "ngram" method): drafts come from the request's own tokens.

For the longest n in [prompt_lookup_max .. prompt_lookup_min] whose last n tokens occurred earlier in
prompt + output, the drafts are the (up to) k tokens that followed that earlier occurrence; of several
occurrences the most recent is taken (the nearest context is the likeliest to repeat). No match: no
drafts, and the step decodes one token as usual. Pure host work on numpy arrays, no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 1:
            raise ValueError(f"NgramProposer: need 1 <= prompt_lookup_min={prompt_lookup_min} <= prompt_lookup_max="
                             f"{prompt_lookup_max} and num_speculative_tokens={num_speculative_tokens} >= 1")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_for(self, request: Any, max_drafts: int) -> list[int]:
        """Drafts for a scheduler Request, its tokens kept in a growing array on the request
        (`draft_state`), so a step converts only the tokens new since the last one, not the whole context."""
        buffer, length = request.draft_state or (np.empty(0, dtype=np.int64), 0)
        total = request.num_tokens
        if total > buffer.shape[0]:
            grown = np.empty(max(total, 2 * buffer.shape[0]), dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        if total > length:
            buffer[length:total] = request.token_slice(length, total)
        request.draft_state = (buffer, total)
        return self.propose(buffer[:total], max_drafts)

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `token_ids` (prompt + output so far)."""
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = tokens.shape[0]
        if limit <= 0 or total < self.min_n + 1:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self._latest_match(tokens, n)
            if start is not None:
                follow = start + n
                return tokens[follow : follow + limit].tolist()
        return []

    @staticmethod
    def _latest_match(tokens: np.ndarray, n: int) -> int | None:
        """The last start i < len - n with tokens[i:i+n] equal to the final n tokens, or None."""
        total = tokens.shape[0]
        pattern = tokens[total - n :]
        # candidate starts: before the suffix itself, so that at least one token follows the match
        candidates = np.flatnonzero(tokens[: total - n] == pattern[0])
        for offset in range(1, n):
            if candidates.size == 0:
                return None
            candidates = candidates[tokens[candidates + offset] == pattern[offset]]
        return int(candidates[-1]) if candidates.size else None
