"""Chained 128-bit hashes of full KV blocks: hash(parent hash, the block's token ids, extra keys).

The same hash names a block in the device cache, in a future offload tier and in KV transfer, and
names the KDA state checkpoint taken at the block's end (a checkpoint at boundary P is filed under
the hash of the block that ends at P).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """The hash of one full block, given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes` (in place); returns it."""
    return append_block_hashes(hashes, token_ids[len(hashes) * block_size :], block_size, extra_keys)


def append_block_hashes(
    hashes: list[BlockHash], new_token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `new_token_ids`, the tokens that follow the blocks
    already in `hashes` (in place); returns it. Costs the new tokens, not the whole sequence."""
    for start in range(0, len(new_token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, new_token_ids[start : start + block_size], extra_keys))
    return hashes
