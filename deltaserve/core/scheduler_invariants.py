"""The scheduler's bookkeeping invariants, checked by the tests and the fuzzers after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltaserve.core.block_hash import BlockHash
from deltaserve.core.request import RequestStatus
from deltaserve.core.spec_decode import spare_key

if TYPE_CHECKING:
    from deltaserve.core.scheduler import Scheduler


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Raise AssertionError unless every KV block, state slot, checkpoint unit and pin is accounted for."""
    from deltaserve.core.scheduler import boundary_key

    kv = scheduler.kv_cache_manager
    held: dict[int, int] = {}
    transfers = {**scheduler.remote_waiting, **scheduler._abandoned_loads, **scheduler.held_for_transfer,
                 **scheduler.tier_waiting}
    for request_id, table in kv._tables.items():
        request = scheduler.requests.get(request_id) or transfers.get(request_id)
        assert request is not None and (request.status == RequestStatus.RUNNING or request_id in transfers), \
            f"{request_id} holds KV blocks but is not running"
        for block in table:
            held[block] = held.get(block, 0) + 1
    kv.pool.check_invariants(held)
    holders = [r.request_id for r in scheduler.running] + list(transfers)
    expected_owners = set(holders)
    if scheduler.prefix_cache is not None:
        expected_owners |= {boundary_key(r) for r in holders}
    expected_owners |= {spare_key(r, i) for r in holders for i in range(1, scheduler.num_spare_slots + 1)}
    owners = set(scheduler.state_pool._owner)
    assert owners == expected_owners, f"state slots held by {sorted(owners ^ expected_owners)} (running or not)"
    slots = list(scheduler.state_pool._owner.values()) + scheduler.state_pool._free
    assert sorted(slots) == list(range(scheduler.state_pool.num_slots)), "a state slot is lost or held twice"
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting)
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in scheduler.remote_waiting.values())
    assert all(r.status == RequestStatus.WAITING_FOR_TIER_LOAD for r in scheduler.tier_waiting.values())
    assert len(scheduler.requests) == (len(scheduler.running) + len(scheduler.waiting) + len(scheduler.remote_waiting)
                                  + len(scheduler.tier_waiting)), \
        "a request is neither running nor waiting"
    for request in scheduler.requests.values():
        pending = sum(request.request_id in r.samples and r.lives[request.request_id] == request.num_preemptions
                      for r in scheduler.in_flight.values())
        assert request.num_pending_outputs == pending, \
            f"{request.request_id}: {request.num_pending_outputs} placeholders, {pending} sampling steps in flight"
    for request_id, sent in scheduler._sent_blocks.items():
        assert request_id in scheduler.requests and scheduler.requests[request_id].status == RequestStatus.RUNNING
        assert sent <= len(kv.block_ids(request_id)), f"{request_id}: more block ids sent than it holds"
    pc = scheduler.prefix_cache
    if pc is None:
        return
    pins: dict[BlockHash, int] = {}
    for record in scheduler.in_flight.values():
        for cp in record.pinned:
            pins[cp.block_hash] = pins.get(cp.block_hash, 0) + 1
    pc.checkpoints.check_invariants(pins)
    for h, cp in pc.checkpoints._lru.items():
        if cp.visible:
            assert kv.pool.cached_block(h) is not None, f"checkpoint at {cp.num_tokens} tokens is unreachable"
