"""Split a cache budget between paged KV blocks and KDA state slots."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec

MiB = 1 << 20


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    num_state_slots: int
    kv_bytes: int
    state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def plan_cache(
    cache_bytes: int, kv_spec: MLALatentSpec, state_spec: KDAStateSpec, max_num_seqs: int, max_model_len: int
) -> CachePlan:
    """One state slot per concurrent sequence (up to `max_num_seqs`), the rest of the budget in KV blocks.

    Refuses (ValueError) a budget that cannot hold one sequence of `max_model_len` tokens, saying
    what to change. When the budget cannot give every one of `max_num_seqs` sequences a state slot
    while keeping one full-length sequence's blocks, fewer slots are planned.
    """
    block_bytes = kv_spec.bytes_per_block
    image_bytes = state_spec.bytes_per_image
    blocks_one_seq = kv_spec.blocks_for(max_model_len)
    one_seq = blocks_one_seq * block_bytes + image_bytes
    if cache_bytes < one_seq:
        raise ValueError(
            f"the cache budget of {cache_bytes / MiB:.1f} MiB cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens ({blocks_one_seq} KV blocks of {block_bytes} bytes plus a "
            f"{image_bytes / MiB:.2f} MiB KDA state image = {one_seq / MiB:.1f} MiB); raise cache_memory "
            f"(--cache-memory) or gpu_memory_utilization, or lower max_model_len"
        )
    if image_bytes == 0:
        slots = max_num_seqs
    else:
        slots = max(1, min(max_num_seqs, (cache_bytes - blocks_one_seq * block_bytes) // image_bytes))
    state_bytes = slots * image_bytes
    if block_bytes == 0:
        num_blocks = blocks_one_seq * slots
    else:
        num_blocks = (cache_bytes - state_bytes) // block_bytes
    return CachePlan(num_blocks, slots, num_blocks * block_bytes, state_bytes)
