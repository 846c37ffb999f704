"""Block pool, KV cache manager, state slot pool and cache sizing: exact ids and byte counts."""

from __future__ import annotations

import pytest

from deltaserve.core.block_pool import BlockPool
from deltaserve.core.cache_sizing import plan_cache
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.state_pool import StateSlotPool

KV = MLALatentSpec(block_size=4, num_layers=2, latent_dim=10, dtype_bytes=2)
STATE = KDAStateSpec(
    num_layers=3, num_heads=2, head_k_dim=4, head_v_dim=4, conv_dim=24, conv_window=3, conv_dtype_bytes=2
)


def test_spec_bytes():
    assert KV.bytes_per_token == 2 * 10 * 2
    assert KV.bytes_per_block == 4 * 40
    assert KV.blocks_for(0) == 0 and KV.blocks_for(4) == 1 and KV.blocks_for(5) == 2
    assert STATE.conv_bytes_per_layer == 24 * 3 * 2
    assert STATE.recurrent_bytes_per_layer == 2 * 4 * 4 * 4
    assert STATE.bytes_per_image == 3 * (144 + 128)


def test_block_pool_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.allocate(2)
    pool.release([1])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="block 1"):
        pool.release([1])
    assert pool.allocate(2) == [3, 1]


def test_kv_manager_grows_and_frees():
    manager = KVCacheManager(KV, 5)
    assert manager.allocate_slots("a", 5) == [0, 1]
    assert manager.allocate_slots("a", 8) == [0, 1]
    assert manager.allocate_slots("a", 9) == [0, 1, 2]
    assert manager.allocate_slots("b", 9) is None  # needs 3, 2 free: nothing changes
    assert manager.block_ids("b") == [] and manager.num_free_blocks == 2
    assert manager.allocate_slots("b", 8) == [3, 4]
    assert manager.usage == 1.0
    manager.free("a")
    manager.free("b")
    manager.free("unknown")
    assert manager.num_free_blocks == 5 and manager.usage == 0.0


def test_state_pool():
    pool = StateSlotPool(2)
    assert pool.allocate("a") == 0
    assert pool.allocate("a") == 0
    assert pool.allocate("b") == 1
    assert pool.allocate("c") is None
    pool.free("a")
    assert pool.num_free == 1 and pool.slot_of("a") is None
    assert pool.allocate("c") == 0


def test_plan_cache_splits_budget():
    image, block = STATE.bytes_per_image, KV.bytes_per_block
    plan = plan_cache(10 * image + 100 * block, KV, STATE, max_num_seqs=4, max_model_len=64)
    assert plan.num_state_slots == 4
    assert plan.num_blocks == (6 * image + 100 * block) // block
    assert plan.state_bytes == 4 * image and plan.kv_bytes == plan.num_blocks * block
    assert plan.total_bytes <= 10 * image + 100 * block


def test_plan_cache_fewer_slots_when_tight():
    image, block = STATE.bytes_per_image, KV.bytes_per_block
    plan = plan_cache(2 * image + 16 * block, KV, STATE, max_num_seqs=8, max_model_len=64)
    assert plan.num_state_slots == 2 and plan.num_blocks == 16


def test_plan_cache_refuses_budget_below_one_sequence():
    with pytest.raises(ValueError, match="max_model_len=64.*cache-memory"):
        plan_cache(16 * KV.bytes_per_block, KV, STATE, max_num_seqs=1, max_model_len=64)
