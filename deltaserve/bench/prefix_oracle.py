"""The infinite-cache oracle of prefix caching: a trie of block keys that never evicts.

A request could at best skip the longest leading run of its blocks that some earlier request already
computed; `InfinitePrefixCache` answers that for any block keys (Mooncake hash ids, or hashes of the
token ids of each full block) and remembers every run it is given.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One key per full block of `token_ids` (a trailing partial block has none): equal blocks, equal keys."""
    return [hash(tuple(token_ids[i:i + block_size])) for i in range(0, len(token_ids) - block_size + 1, block_size)]


class InfinitePrefixCache:
    """Leading runs of block keys seen so far, as a trie; node 0 is the root."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, Hashable], int] = {}

    def match(self, keys: Sequence[Hashable], max_blocks: int | None = None) -> int:
        """How many leading blocks of `keys` (at most `max_blocks`) an earlier `insert` already holds."""
        node, n = 0, 0
        for key in keys[:max_blocks]:
            child = self._children.get((node, key))
            if child is None:
                break
            node, n = child, n + 1
        return n

    def hit_tokens(self, keys: Sequence[Hashable], num_prompt_tokens: int, block_size: int) -> int:
        """Tokens of a prompt (`keys` those of its blocks of `block_size` tokens) an earlier `insert` could
        serve: its leading blocks already held, never covering its last token (that one is computed)."""
        return self.match(keys, (num_prompt_tokens - 1) // block_size) * block_size

    def insert(self, keys: Sequence[Hashable]) -> None:
        """Remember every leading run of `keys`."""
        node = 0
        for key in keys:
            node = self._children.setdefault((node, key), len(self._children) + 1)
