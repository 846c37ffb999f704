"""A seeded fuzz of the scheduler with up to four steps in flight, against a fake worker that keeps the
caches' contents.

The fake worker keeps block tables as the real one does (`BlockTables`, sent incrementally) and
stores, per KV block, the token at each position; per state slot and checkpoint unit, a rolling
hash of the tokens the state has consumed. Running a chunk reads the request's earlier
tokens back out of its blocks and checks that its state slot holds exactly their hash, so a wrong
prefix hit, a checkpoint loaded before it was saved, or a block overwritten while still findable
fails at once. The sampled token is a function of that state, so outputs depend only on what the
caches held. Steps run (and are reported) in the order they were scheduled, up to `depth` of them
later; decodes scheduled on a token still in flight carry a placeholder, which the fake worker
fills in from what it sampled, as the real one does. Every workload runs with prefix caching off
and one step in flight as the reference; every configuration must give the same outputs, and
`check_invariants()` must hold after every step.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import MLALatentSpec
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.worker.block_tables import BlockTables

BS = 4
VOCAB = 50
MOD = (1 << 61) - 1


def roll(state: int, tokens: list[int]) -> int:
    for t in tokens:
        state = (state * 1_000_003 + t + 1) % MOD
    return state


class FakeWorker:
    """The caches' contents, and a "model" whose next token is a function of the KDA state."""

    def __init__(self, num_blocks: int, num_slots: int, num_units: int) -> None:
        self.blocks: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.slots: list[int | None] = [None] * num_slots
        self.units: list[int | None] = [None] * max(num_units, 1)
        self.tables = BlockTables(rows=2, width=2)  # the real worker's incremental tables, grown from tiny
        self.last_sampled: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self.tables.drop(out.finished_request_ids + out.preempted_request_ids)
        for request_id in out.finished_request_ids + out.preempted_request_ids:
            self.last_sampled.pop(request_id, None)
        for save in out.state_saves_before:
            self._save(save.state_slot, save.unit_ids)
        for load in out.state_loads:
            images = {self.units[u] for u in load.unit_ids}
            assert len(images) == 1 and None not in images, "a checkpoint loaded before it was saved"
            self.slots[load.state_slot] = images.pop()
        sampled = {}
        for chunk in out.chunks:
            self.tables.apply(chunk)
            table = self.tables.ids(chunk.request_id)
            start = chunk.num_computed_tokens
            assert len(table) * BS >= start + chunk.num_tokens, f"{chunk.request_id}: its table is too short"
            before = [self._read(table, p) for p in range(start)]
            state = 0 if start == 0 else self.slots[chunk.state_slot]
            assert state == roll(0, before), f"{chunk.request_id}: the state does not match its KV at {start}"
            tokens = list(chunk.token_ids)
            if PLACEHOLDER_TOKEN_ID in tokens:
                assert tokens == [PLACEHOLDER_TOKEN_ID] and start > 0, f"{chunk.request_id}: placeholder {tokens}"
                tokens = [self.last_sampled[chunk.request_id]]
            for i, token in enumerate(tokens):
                block, offset = divmod(start + i, BS)
                self.blocks[table[block]][offset] = token
            for point, unit_ids in chunk.state_captures:  # checkpoints inside the chunk: the state there
                assert 0 < point < len(tokens), f"{chunk.request_id}: capture at {point} of {len(tokens)}"
                for u in unit_ids:
                    self.units[u] = roll(state, tokens[:point])
            state = roll(state, tokens)
            self.slots[chunk.state_slot] = state
            if chunk.sample:
                sampled[chunk.request_id] = self.last_sampled[chunk.request_id] = state % VOCAB
        for save in out.state_saves_after:
            self._save(save.state_slot, save.unit_ids)
        for copy in out.state_copies_after:
            self.slots[copy.dst_slot] = self.slots[copy.src_slot]
        return sampled

    def _read(self, table: list[int], position: int) -> int:
        token = self.blocks[table[position // BS]][position % BS]
        assert token is not None, f"position {position} read before it was written"
        return token

    def _save(self, slot: int, unit_ids: list[int]) -> None:
        assert self.slots[slot] is not None
        for u in unit_ids:
            self.units[u] = self.slots[slot]


def workload(seed: int) -> list[dict]:
    """Requests over a few shared prefixes, with exact duplicates, arriving and aborting at set ticks."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    specs = []
    for i in range(rng.randrange(8, 20)):
        if specs and rng.random() < 0.25:
            spec = dict(specs[rng.randrange(len(specs))])  # a duplicate, maybe in flight with its twin
            spec["id"] = f"r{i}"
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            spec = {"id": f"r{i}", "prompt": prompt, "max_tokens": rng.randrange(1, 14)}
        spec["arrive"] = rng.randrange(0, 30)
        spec["abort"] = spec["arrive"] + rng.randrange(1, 40) if rng.random() < 0.15 else None
        specs.append(spec)
    return specs


def run(specs: list[dict], depth: int, caching: bool, num_blocks: int, units: int, budget: int,
        ) -> dict[str, tuple[list[int], str | None]]:
    """Drive the scheduler tick by tick; (output tokens, finish reason) of every request."""
    kv = KVCacheManager(MLALatentSpec(BS, 1, 8, 2), num_blocks, enable_prefix_caching=caching)
    pool = CheckpointPool(units, unit_bytes=64, image_bytes=64)
    pc = PrefixCache(kv, pool, 8, kernel_chunk=8) if caching else None  # a grid of 8 over blocks of 4
    slots = 12
    config = SchedulerConfig(max_num_seqs=slots // (2 if caching else 1), max_num_batched_tokens=budget,
                             max_model_len=128)
    s = Scheduler(config, kv, StateSlotPool(slots), pc)
    worker = FakeWorker(num_blocks, slots, units)
    requests: dict[str, Request] = {}
    queue: deque[SchedulerOutput] = deque()
    last_arrival = max(40, *(spec["arrive"] for spec in specs))  # a second round may come after a lull
    for tick in range(5000):
        for spec in specs:
            if spec["arrive"] == tick:
                requests[spec["id"]] = Request(spec["id"], list(spec["prompt"]), spec["max_tokens"], (-1,))
                s.add_request(requests[spec["id"]])
            if spec["abort"] == tick:
                s.finish_requests([spec["id"]], RequestStatus.FINISHED_ABORTED)
        queue.append(s.schedule())
        s.check_invariants()
        while queue and (len(queue) >= depth or not s.has_unfinished_requests()):
            out = queue.popleft()
            s.update_from_output(out, worker.execute(out))
            s.check_invariants()
        if tick > last_arrival and not (s.has_unfinished_requests() or s.has_pending_saves or queue):
            break
    else:
        pytest.fail("the workload never finished")
    assert kv.num_free_blocks == num_blocks and s.state_pool.num_free == slots
    if pc is not None:
        assert pc.checkpoints.num_pinned == 0
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in requests.items()}


@pytest.mark.parametrize("seed", range(12))
def test_steps_in_flight_keep_outputs_and_invariants(seed):
    specs = workload(seed)
    rng = random.Random(1000 + seed)
    num_blocks = rng.choice([20, 28, 40, 64])  # tight: preemption and eviction both happen
    reference = run(specs, depth=1, caching=False, num_blocks=num_blocks, units=0, budget=24)
    for depth in (1, 2, 3, 4):
        for caching in (False, True):
            units = rng.choice([1, 2, 4, 8])
            got = run(specs, depth, caching, num_blocks, units, budget=rng.choice([8, 16, 24]))
            for rid, (tokens, reason) in got.items():
                ref_tokens, ref_reason = reference[rid]
                if reason == "abort" or ref_reason == "abort":  # cut at a tick: only a prefix is comparable
                    n = min(len(tokens), len(ref_tokens))
                    assert tokens[:n] == ref_tokens[:n], (rid, depth, caching)
                else:
                    assert (tokens, reason) == (ref_tokens, ref_reason), (rid, depth, caching)
