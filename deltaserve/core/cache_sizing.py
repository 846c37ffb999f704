"""Split a cache budget between live KDA state slots, KDA state checkpoint units and paged KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.checkpoint_grid import checkpoint_grid
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec

MiB = 1 << 20
MAX_UNIT_BYTES = 1 << 20
UNIT_ALIGN = 256


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    num_state_slots: int
    kv_bytes: int
    state_bytes: int
    num_checkpoint_units: int = 0
    checkpoint_unit_bytes: int = 0

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoint_units * self.checkpoint_unit_bytes

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.checkpoint_bytes


def default_unit_bytes(image_bytes: int) -> int:
    """Units of at most 1 MiB, aligned: a 48B-shape image (about 43 MB) takes 42 of them."""
    unit = min(max(image_bytes, 1), MAX_UNIT_BYTES)
    return -(-unit // UNIT_ALIGN) * UNIT_ALIGN


def default_checkpoint_interval(kv_spec: MLALatentSpec, state_spec: KDAStateSpec, grid: int | None = None) -> int:
    """Rungs about as far apart as the tokens whose KV takes the bytes of one checkpoint: a power of
    two multiple of the checkpoint grid (tiny preset: 128 tokens; the 48B shape in bfloat16: 8192);
    `grid`: a coarser grid than the block's (the offload tier's chunk)."""
    tokens = state_spec.bytes_per_image / max(kv_spec.bytes_per_token, 1)
    interval = grid or checkpoint_grid(kv_spec.block_size)
    while interval < tokens:
        interval *= 2
    return interval


def _what_fits(cache_bytes: int, kv_spec: MLALatentSpec, seq_state_bytes: int, slots_per_seq: int) -> str:
    """The advice ending plan_cache's refusal: the largest max_model_len whose one sequence (whole KV
    blocks plus `seq_state_bytes` of KDA state) fits in `cache_bytes`, or that none does."""
    raise_budget = "raise cache_memory (--cache-memory) or gpu_memory_utilization"
    room = cache_bytes - seq_state_bytes
    # with 0-byte blocks the budget is refused only when the state alone does not fit (room < 0)
    blocks = room // kv_spec.bytes_per_block if room > 0 and kv_spec.bytes_per_block else 0
    if blocks == 0:
        return (f"not even one KV block of {kv_spec.block_size} tokens fits beside {slots_per_seq} KDA state "
                f"image(s), so a lower max_model_len cannot help: {raise_budget}")
    return (f"{raise_budget}, or lower max_model_len (--max-model-len, which defaults to the model's "
            f"max_position_embeddings): the largest max_model_len that fits is {blocks * kv_spec.block_size}")


def plan_cache(
    cache_bytes: int,
    kv_spec: MLALatentSpec,
    state_spec: KDAStateSpec,
    max_num_seqs: int,
    max_model_len: int,
    slots_per_seq: int = 1,
    checkpoint_fraction: float = 0.0,
    checkpoint_unit_bytes: int | None = None,
) -> CachePlan:
    """`slots_per_seq` state slots per concurrent sequence (up to `max_num_seqs` sequences), then
    `checkpoint_fraction` of what is left in checkpoint units, the rest in KV blocks.

    Refuses (ValueError) a budget that cannot hold one sequence of `max_model_len` tokens (and, with
    checkpoints, one checkpoint), saying what to change and the largest max_model_len that fits. A
    tight budget gets fewer slots (fewer concurrent sequences) and fewer units rather than less than
    one full-length sequence of KV.
    """
    block_bytes = kv_spec.bytes_per_block
    seq_state = slots_per_seq * state_spec.bytes_per_image
    blocks_one_seq = kv_spec.blocks_for(max_model_len)
    unit_bytes = one_checkpoint = 0
    if checkpoint_fraction > 0 and state_spec.bytes_per_image > 0:
        unit_bytes = checkpoint_unit_bytes or default_unit_bytes(state_spec.bytes_per_image)
        one_checkpoint = -(-state_spec.bytes_per_image // unit_bytes) * unit_bytes
    one_seq = blocks_one_seq * block_bytes + seq_state + one_checkpoint
    if cache_bytes < one_seq:
        checkpoint = f" and one state checkpoint of {one_checkpoint / MiB:.2f} MiB" if one_checkpoint else ""
        raise ValueError(
            f"the cache budget of {cache_bytes / MiB:.1f} MiB cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens ({blocks_one_seq} KV blocks of {block_bytes} bytes plus "
            f"{slots_per_seq} KDA state image(s) of {state_spec.bytes_per_image / MiB:.2f} MiB{checkpoint} = "
            f"{one_seq / MiB:.1f} MiB); "
            + _what_fits(cache_bytes, kv_spec, seq_state + one_checkpoint, slots_per_seq)
        )
    if seq_state == 0:
        seqs = max_num_seqs
    else:
        room = cache_bytes - blocks_one_seq * block_bytes - one_checkpoint
        seqs = max(1, min(max_num_seqs, room // seq_state))
    state_bytes = seqs * seq_state
    rest = cache_bytes - state_bytes
    units = 0
    if one_checkpoint:
        spare = rest - blocks_one_seq * block_bytes
        units = max(min(int(rest * checkpoint_fraction), spare), one_checkpoint) // unit_bytes
    rest -= units * unit_bytes
    num_blocks = blocks_one_seq * seqs if block_bytes == 0 else rest // block_bytes
    return CachePlan(
        num_blocks=num_blocks,
        num_state_slots=seqs * slots_per_seq,
        kv_bytes=num_blocks * block_bytes,
        state_bytes=state_bytes,
        num_checkpoint_units=units,
        checkpoint_unit_bytes=unit_bytes,
    )
