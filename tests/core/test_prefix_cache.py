"""Prefix caching on its own (no model): block cache tiers, checkpoint units, joint hits, each kind of
checkpoint producing the hit it exists for, eviction, nothing leaked."""

from __future__ import annotations

import pytest

from deltaserve.core.block_hash import extend_block_hashes, hash_block
from deltaserve.core.block_pool import BlockPool
from deltaserve.core.checkpoint_pool import CheckpointKind, CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import MLALatentSpec
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.state_pool import StateSlotPool

BS = 4


def test_hashes_chain_and_extend():
    a = hash_block(None, [1, 2, 3, 4])
    assert len(a) == 16 and hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt",)) != a
    hashes = extend_block_hashes([], list(range(1, 11)), BS)
    assert len(hashes) == 2 and hashes[0] == a
    assert extend_block_hashes(hashes, list(range(1, 13)), BS) is hashes and len(hashes) == 3


def test_block_pool_eviction_tiers_and_subtree_drop():
    pool = BlockPool(6)
    dropped = []
    pool.on_drop = dropped.append
    ids = pool.allocate(4)
    h = [bytes([i]) * 16 for i in range(4)]
    for i in range(3):  # a chain of three cached blocks; block 3 stays plain
        assert pool.cache_block(ids[i], h[i], h[i - 1] if i else None)
    assert not pool.cache_block(ids[3], h[3], b"x" * 16)  # parent not cached
    assert pool.cache_block(ids[3], h[0], None)  # hash cached elsewhere: block 3 is its duplicate
    assert pool.cached_block(h[0]) == ids[0]
    pool.add_servability(h[1], +1)  # a checkpoint at block 1 serves blocks 0 and 1
    pool.release(ids[::-1])
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    # plain blocks go first (the 2 never used, then block 3), then unservable block 2, then the servable ones
    assert pool.allocate(3) == [4, 5, ids[3]]
    assert pool.allocate(1) == [ids[2]] and dropped == [h[2]]
    pool.touch([pool.cached_block(h[0])])  # a hit takes a cached free block out of the free queues
    assert pool.num_free_blocks == 1
    pool.release([ids[0]])
    got = pool.allocate(1)  # LRU among servable: block 1 (freed before block 0 was touched again)
    assert got == [ids[1]] and pool.num_cached_blocks == 1


def test_evicting_a_block_drops_its_subtree():
    pool = BlockPool(3)
    dropped = []
    pool.on_drop = dropped.append
    ids = pool.allocate(3)
    h = [bytes([i]) * 16 for i in range(3)]
    for i in range(3):
        pool.cache_block(ids[i], h[i], h[i - 1] if i else None)
    pool.release([ids[1], ids[2], ids[0]])
    # LRU picks block 1, which takes block 2 (its child, now unreachable) with it
    assert pool.allocate(1) == [ids[1]]
    assert set(dropped) == {h[1], h[2]} and pool.num_cached_blocks == 1
    assert pool.allocate(1) == [ids[2]]  # the dropped child is a plain free block now


def test_checkpoint_pool_units_lru_and_pins():
    pool = CheckpointPool(num_units=7, unit_bytes=100, image_bytes=250)
    assert pool.units_per_checkpoint == 3 and pool.capacity == 2
    changes = []
    pool.on_change = lambda h, d: changes.append((h, d))
    a = pool.file(b"a" * 16, 4, CheckpointKind.RUNG)
    assert a is not None and len(a.unit_ids) == 3 and pool.lookup(b"a" * 16) is None  # its save is not scheduled
    pool.publish(a.block_hash)
    assert pool.lookup(a.block_hash) is a and changes == [(a.block_hash, 1)]
    assert pool.file(a.block_hash, 4, CheckpointKind.RUNG) is None  # exists
    b = pool.file(b"b" * 16, 8, CheckpointKind.PROMPT_END)
    pool.publish(b.block_hash)
    a.pins = 1
    assert pool.file(b"c" * 16, 12, CheckpointKind.DEMAND) is None  # b is findable but not written: kept
    pool.mark_written(b.block_hash, b)
    c = pool.file(b"c" * 16, 12, CheckpointKind.DEMAND)  # a is pinned: b goes
    assert c is not None and pool.get(b.block_hash) is None and pool.stats.evicted["prompt_end"] == 1
    assert pool.file(b"d" * 16, 16, CheckpointKind.RUNG) is None  # a pinned, c unwritten: no room
    assert pool.stats.declined_no_units == 2
    pool.free(a.block_hash)
    pool.free(c.block_hash)
    assert pool.num_free_units == 7 and pool.num_checkpoints == 0


# The scheduler with prefix caching --------------------------------------------------------------
def make(num_blocks=64, units=16, interval=64, slots=16, budget=100, kernel_chunk=BS):
    """A scheduler with prefix caching; the checkpoint grid is the block size unless kernel_chunk says."""
    kv = KVCacheManager(MLALatentSpec(BS, 1, 8, 2), num_blocks, enable_prefix_caching=True)
    pc = PrefixCache(kv, CheckpointPool(units, unit_bytes=64, image_bytes=64), interval, kernel_chunk=kernel_chunk)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024)
    return Scheduler(config, kv, StateSlotPool(slots), pc)


def request(rid, prompt, max_tokens=1):
    return Request(rid, list(prompt), max_tokens, eos_token_ids=(-1,))


def drain(s, token=500):
    """Run steps to completion; every step's scheduler output."""
    outs = []
    while s.has_unfinished_requests() or s.has_pending_saves:  # the last finish's saves need a step too
        out = s.schedule()
        outs.append(out)
        s.update_from_output(out, {c.request_id: token + c.num_output_tokens for c in out.chunks if c.sample})
        s.check_invariants()
    return outs


def finish_step(s, out, token=600):
    s.update_from_output(out, {c.request_id: token for c in out.chunks if c.sample})
    s.check_invariants()


def chunk_spans(outs, rid):
    return [(c.num_computed_tokens, c.num_computed_tokens + c.num_tokens) for o in outs for c in o.chunks
            if c.request_id == rid]


def assert_all_free(s):
    s.check_invariants()
    assert not s.in_flight and not s.has_pending_saves
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    assert s.state_pool.num_free == s.state_pool.num_slots
    assert all(cp.pins == 0 for cp in s.prefix_cache.checkpoints._lru.values())


def test_rungs_and_prompt_end_anchor_are_captured_inside_one_chunk():
    s = make(interval=16)
    s.add_request(request("a", range(1, 38)))
    outs = drain(s)
    assert chunk_spans(outs, "a") == [(0, 37)]  # one pass: no chunk ends at a checkpoint
    kinds = sorted((cp.num_tokens, cp.kind) for cp in s.prefix_cache.checkpoints._lru.values())
    assert kinds == [(16, CheckpointKind.RUNG), (32, CheckpointKind.RUNG), (36, CheckpointKind.PROMPT_END)]
    (chunk,) = outs[0].chunks
    units = {cp.num_tokens: tuple(cp.unit_ids) for cp in s.prefix_cache.checkpoints._lru.values()}
    assert chunk.state_captures == ((16, units[16]), (32, units[32]), (36, units[36]))
    assert sum(len(o.state_saves_after) for o in outs) == 0
    # a rung serves a prompt that shares the first 34 tokens only
    s.add_request(request("b", list(range(1, 35)) + [900, 901, 902]))
    out = s.schedule()
    (load,) = out.state_loads
    assert out.chunks[0].num_computed_tokens == 32 and s.get_request("b").num_cached_tokens == 32
    assert load.state_slot == out.chunks[0].state_slot
    finish_step(s, out)
    # the prompt-end anchor serves the same prompt continued
    s.add_request(request("c", list(range(1, 38)) + [7, 7]))
    out = s.schedule()
    assert [c.num_computed_tokens for c in out.chunks if c.request_id == "c"] == [36]
    finish_step(s, out)
    drain(s)
    assert_all_free(s)


def test_every_checkpoint_sits_on_the_one_grid():
    """Block size 4, a kernel chunk of 8: rungs, the prompt-end anchor and the end-of-sequence anchor
    all land on multiples of 8, never on the block edges between them."""
    s = make(interval=16, kernel_chunk=8)
    assert s.prefix_cache.grid == 8
    s.add_request(request("a", range(1, 38), max_tokens=7))  # prompt 37: last grid point 32, not 36
    outs = drain(s)
    assert chunk_spans(outs, "a")[:2] == [(0, 37), (37, 38)]
    assert [point for point, _ in outs[0].chunks[0].state_captures] == [16, 32]
    kinds = sorted((cp.num_tokens, cp.kind.value) for cp in s.prefix_cache.checkpoints._lru.values())
    assert kinds == [(16, "rung"), (32, "prompt_end"), (40, "end_of_sequence")]  # decode reached 43
    with pytest.raises(ValueError, match="multiple of the checkpoint grid"):
        make(interval=12, kernel_chunk=8)
    assert_all_free(s)


def test_an_offload_chunk_coarsens_the_grid_every_checkpoint_sits_on():
    """With the offload tier's chunk of 16 tokens (block 4, kernel chunk 8) every checkpoint sits on a
    multiple of 16: the prompt-end anchor of a 45-token prompt floors to 32 (the grid of 8 alone puts
    it at 40)."""
    kv = KVCacheManager(MLALatentSpec(BS, 1, 8, 2), 64, enable_prefix_caching=True)
    pc = PrefixCache(kv, CheckpointPool(16, unit_bytes=64, image_bytes=64), 16, kernel_chunk=8, offload_chunk=16)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=1024), kv,
                  StateSlotPool(16), pc)
    assert pc.grid == 16
    s.add_request(request("a", range(1, 46), max_tokens=3))  # prompt 45: grid points 16 and 32
    drain(s)
    boundaries = sorted(cp.num_tokens for cp in pc.checkpoints._lru.values())
    assert all(b % 16 == 0 for b in boundaries) and 32 in boundaries and 40 not in boundaries
    with pytest.raises(ValueError, match="and the offload chunk of 24"):
        PrefixCache(kv, CheckpointPool(16, unit_bytes=64, image_bytes=64), 16, kernel_chunk=8, offload_chunk=24)
    assert_all_free(s)


def test_end_of_sequence_anchor_serves_the_next_turn():
    s = make()
    prompt = list(range(1, 11))
    s.add_request(request("turn1", prompt, max_tokens=9))
    outs = drain(s)
    copies = [c for o in outs for c in o.state_copies_after]
    assert len(copies) == 2  # decode crossed the boundaries at 12 and 16
    saves_before = [sv for o in outs for sv in o.state_saves_before]
    assert len(saves_before) == 1 and saves_before[0].state_slot == copies[-1].dst_slot
    answer = [500 + i for i in range(9)]
    # next turn: previous prompt + answer + a new message; the hit ends where decode last crossed a boundary
    s.add_request(request("turn2", prompt + answer + [42, 43, 44]))
    out = s.schedule()
    assert out.chunks[0].num_computed_tokens == 16 and out.state_loads
    assert s.prefix_cache.checkpoints.get(s.get_request("turn2").block_hashes[3]).kind == (
        CheckpointKind.END_OF_SEQUENCE
    )
    finish_step(s, out)
    drain(s)
    assert_all_free(s)


def test_demand_checkpoint_fills_the_gap_for_the_next_request():
    s = make(interval=64)
    shared = list(range(1, 23))
    s.add_request(request("a", shared + [100] * 8))  # files only its prompt-end anchor at 28
    drain(s)
    s.add_request(request("b", shared + [200] * 8))
    out = s.schedule()
    b = s.get_request("b")
    assert b.num_cached_tokens == 0  # KV for [0, 20) is cached but no checkpoint sits at 20
    assert s.prefix_cache.stats.tokens_lost_to_missing_checkpoint == 20
    assert chunk_spans([out], "b") == [(0, 30)]
    assert [point for point, _ in out.chunks[0].state_captures] == [20, 28]  # the demanded point, the anchor
    finish_step(s, out)
    drain(s)
    assert s.prefix_cache.checkpoints.stats.filed["demand"] == 1
    s.add_request(request("c", shared + [300] * 8))
    out = s.schedule()
    assert s.get_request("c").num_cached_tokens == 20 and out.state_loads
    finish_step(s, out)
    drain(s)
    assert_all_free(s)


def test_hit_never_covers_the_last_token():
    s = make()
    s.add_request(request("a", range(1, 17)))  # 16 tokens: anchor at 16
    drain(s)
    # the same prompt again: the anchor at 16 would cover the last token, so the hit could only be at 12,
    # where no checkpoint is; that demand is recorded and b captures one there
    s.add_request(request("b", range(1, 17)))
    outs = drain(s)
    assert s.prefix_cache.stats.hit_tokens == 0 and chunk_spans(outs, "b") == [(0, 16)]
    assert [point for point, _ in outs[0].chunks[0].state_captures] == [12]
    s.add_request(request("c", range(1, 17)))
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.num_computed_tokens, chunk.token_ids, chunk.sample) == (12, [13, 14, 15, 16], True)
    finish_step(s, out)
    drain(s)
    assert_all_free(s)


def test_eviction_under_a_small_cache_frees_everything():
    s = make(num_blocks=12, units=3, interval=8, budget=16)
    for i in range(12):
        prompt = list(range(1, 13)) + [1000 + i] * (5 + i % 7)
        s.add_request(request(f"r{i}", prompt, max_tokens=6))
    drain(s)
    assert_all_free(s)
    pool = s.prefix_cache.checkpoints
    assert sum(pool.stats.evicted.values()) > 0 and pool.num_checkpoints <= pool.capacity
    # every remaining checkpoint still has its whole KV prefix cached
    for cp in pool._lru.values():
        assert s.kv_cache_manager.pool.cached_block(cp.block_hash) is not None


def test_abort_mid_prefill_frees_and_files_no_end_anchor():
    s = make(budget=8)
    s.add_request(request("a", range(1, 40), max_tokens=4))
    out = s.schedule()
    finish_step(s, out)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)
    assert s.schedule().state_saves_before == []


def test_a_request_with_prompt_logprobs_reads_no_hit_but_files_for_others():
    """As vLLM's skip_reading_prefix_cache: its prompt is computed for the logits, uncounted in the hit
    statistics; what it computes and files still serves a later request."""
    s = make(interval=16)

    def scored(rid):
        return Request(rid, list(range(1, 38)), 1, eos_token_ids=(-1,), prompt_logprobs=True)

    s.add_request(scored("first"))
    drain(s)
    assert s.prefix_cache.stats.queries == 0 and s.prefix_cache.checkpoints.num_checkpoints == 3
    s.add_request(request("plain", range(1, 38)))
    out = s.schedule()
    assert out.chunks[0].num_computed_tokens == 36 and out.state_loads  # from first's prompt-end anchor
    finish_step(s, out)
    drain(s)
    s.add_request(scored("again"))
    outs = drain(s)
    assert chunk_spans(outs, "again")[0][0] == 0 and not any(o.state_loads for o in outs)
    assert s.get_request("again") is None and s.prefix_cache.stats.queries == 1
    assert_all_free(s)


def test_a_checkpoint_whose_block_is_evicted_before_its_save_keeps_its_units_until_written():
    """A KV block dropped while the step that saves its checkpoint is still in flight: the checkpoint is
    unfindable at once, but its units are not handed to another checkpoint before that save is reported
    (two saves into one unit in one step corrupted a state the tier fuzz loaded)."""
    pool = CheckpointPool(1, unit_bytes=64, image_bytes=64)
    a = pool.file(b"a" * 16, 8, CheckpointKind.RUNG)
    pool.publish(a.block_hash)
    pool.drop(a.block_hash)  # its block evicted before the save was reported
    assert pool.lookup(a.block_hash) is None and a.doomed
    assert pool.file(b"b" * 16, 8, CheckpointKind.RUNG) is None and pool.num_fileable == 0  # units still held
    pool.publish(a.block_hash)
    assert not a.visible  # never findable again
    pool.mark_written(a.block_hash, a)  # the save is done: now the units go
    assert pool.num_checkpoints == 0 and pool.num_free_units == 1 and pool.stats.evicted["rung"] == 1
    assert pool.file(b"b" * 16, 8, CheckpointKind.RUNG) is not None
