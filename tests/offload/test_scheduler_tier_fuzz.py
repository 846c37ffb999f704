"""The scheduler with the offload tier, fuzzed as tests/core/test_scheduler_fuzz.py fuzzes it alone.

A fake tier (a dict) behind the fake worker: each step's offload saves copy the blocks' tokens and
the units' state hash into it, and its loads copy them back into the request's new blocks and its
state slot, all or nothing. The fake worker then checks, before every chunk, that the request's
state slot holds exactly the hash of the tokens in its blocks, so a tier hit that loaded the wrong
chunk, a state saved before its units were written, or a block the load wrote after a later step
reused it fails at once. The tier also loses objects at random (as a tier evicts, or finds an
object corrupt): those loads fail and the request is recomputed. Saves are reported up to a few
steps late, and from up to four steps in flight. Outputs must equal prefix caching off, and
`check_invariants()` must hold after every step; nothing is held at the end.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest
from core.test_scheduler_fuzz import BS, FakeWorker, run, workload

from deltaserve.core.checkpoint_pool import CheckpointPool
from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import MLALatentSpec
from deltaserve.core.prefix_cache import PrefixCache
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.core.state_pool import StateSlotPool
from deltaserve.offload.metadata import OffloadMetadata, OffloadOutput, OffloadSave
from deltaserve.offload.scheduler_side import OffloadScheduler
from deltaserve.offload.tier_index import TierIndex
from deltaserve.sampling_params import SamplingParams

CHUNK = 8  # two blocks of 4; the checkpoint grid (kernel chunk 8) is the same


class TierWorker(FakeWorker):
    """FakeWorker with a tier: offload saves and loads run where the real rank runs them."""

    def __init__(self, num_blocks: int, num_slots: int, num_units: int, rng: random.Random, loss: float) -> None:
        super().__init__(num_blocks, num_slots, num_units)
        self.tier: dict[tuple[str, bytes], object] = {}
        self.rng, self.loss = rng, loss
        self.reports: list[tuple[int, OffloadOutput]] = []  # (steps until reported, report)
        self.loads_failed = self.loads_done = 0

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], OffloadOutput]:
        meta = out.offload_metadata or OffloadMetadata()
        for save in out.state_saves_before:
            self._save(save.state_slot, save.unit_ids)
        report = OffloadOutput()
        self._saves(meta.saves_before)
        for load in meta.loads:
            keys = [("kv", c.block_hash) for c in load.kv_chunks] + [("state", load.state_hash)]
            if not all(k in self.tier for k in keys):
                report.loads_failed[load.request_id] = "lost"
                self.loads_failed += 1
                continue
            for chunk in load.kv_chunks:
                for block, tokens in zip(chunk.block_ids, self.tier[("kv", chunk.block_hash)], strict=True):
                    self.blocks[block] = list(tokens)
            self.slots[load.state_slot] = self.tier[("state", load.state_hash)]
            report.loads_done.append(load.request_id)
            self.loads_done += 1
        sampled = super().execute(dataclasses.replace(out, state_saves_before=[]))
        self._saves(meta.saves_after)
        for key in list(self.tier):  # the tier loses objects now and then
            if self.rng.random() < self.loss:
                del self.tier[key]
        late = OffloadOutput(saves_done=[s.save_id for s in meta.saves_before + meta.saves_after])
        self.reports.append((self.rng.randrange(0, 3), late))
        return sampled, self._due(report)

    def _saves(self, saves: list[OffloadSave]) -> None:
        for save in saves:
            for chunk in save.kv_chunks:
                tokens = [list(self.blocks[b]) for b in chunk.block_ids]
                assert all(t is not None for block in tokens for t in block), "a KV chunk saved before it was written"
                self.tier[("kv", chunk.block_hash)] = tokens
            if save.state_hash is not None:
                images = {self.units[u] for u in save.unit_ids}
                assert len(images) == 1 and None not in images, "a state image saved before its units were written"
                self.tier[("state", save.state_hash)] = images.pop()

    def _due(self, report: OffloadOutput) -> OffloadOutput:
        """This step's load reports, and the save reports whose delay has run out."""
        kept = []
        for delay, late in self.reports:
            if delay == 0:
                report.saves_done += late.saves_done
            else:
                kept.append((delay - 1, late))
        self.reports = kept
        return report


def run_with_tier(specs: list[dict], depth: int, num_blocks: int, units: int, budget: int, rng: random.Random,
                  loss: float, max_pending: int) -> tuple[dict, TierWorker, OffloadScheduler]:
    kv = KVCacheManager(MLALatentSpec(BS, 1, 8, 2), num_blocks, enable_prefix_caching=True)
    pool = CheckpointPool(units, unit_bytes=64, image_bytes=64)
    pc = PrefixCache(kv, pool, 8, kernel_chunk=8, offload_chunk=CHUNK)
    offload = OffloadScheduler(TierIndex(capacity_bytes=rng.choice([4, 12, 1000]), chunk_tokens=CHUNK, block_size=BS,
                                         kv_chunk_bytes=1, state_image_bytes=1), max_pending)
    slots = 12
    config = SchedulerConfig(max_num_seqs=slots // 2, max_num_batched_tokens=budget, max_model_len=128)
    s = Scheduler(config, kv, StateSlotPool(slots), pc, offload=offload)
    worker = TierWorker(num_blocks, slots, units, rng, loss)
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
            sampled, report = worker.execute(out)
            s.update_from_output(out, sampled, offload_output=report)
            s.check_invariants()
        if tick > last_arrival and not (s.has_unfinished_requests() or s.has_pending_saves or queue):
            break
    else:
        pytest.fail("the workload never finished")
    assert kv.num_free_blocks == num_blocks and s.state_pool.num_free == slots
    assert pc.checkpoints.num_pinned == 0 and not offload.has_pending and not s.tier_waiting
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in requests.items()}, worker, offload


def repeated(specs: list[dict]) -> list[dict]:
    """The workload, then again later under new ids: the second round finds the first's prefixes in
    the tier once HBM has evicted them."""
    later = max(spec["arrive"] for spec in specs) + 60
    again = [dict(spec, id=spec["id"] + "b", arrive=spec["arrive"] + later,
                  abort=None if spec["abort"] is None else spec["abort"] + later) for spec in specs]
    return specs + again


@pytest.mark.parametrize("seed", range(12))
def test_tier_keeps_outputs_and_invariants(seed):
    specs = repeated(workload(seed))
    rng = random.Random(2000 + seed)
    num_blocks = rng.choice([20, 28, 40])
    reference = run(specs, depth=1, caching=False, num_blocks=num_blocks, units=0, budget=24)
    loads = failed = 0
    for depth in (1, 2, 4):
        got, worker, offload = run_with_tier(specs, depth, num_blocks, units=rng.choice([1, 2, 4]),
                                             budget=rng.choice([8, 16, 24]), rng=rng,
                                             loss=rng.choice([0.0, 0.0, 0.05]), max_pending=rng.choice([1, 2, 8]))
        loads += worker.loads_done
        failed += worker.loads_failed
        assert offload.stats.loads_done == worker.loads_done
        for rid, (tokens, reason) in got.items():
            ref_tokens, ref_reason = reference[rid]
            if reason == "abort" or ref_reason == "abort":
                n = min(len(tokens), len(ref_tokens))
                assert tokens[:n] == ref_tokens[:n], (rid, depth)
            else:
                assert (tokens, reason) == (ref_tokens, ref_reason), (rid, depth)
    assert loads > 0, "the second round must load what HBM evicted from the tier"


def _scheduler_with_tier(units: int, max_pending_saves: int, budget: int,
                         admission: str = "all") -> tuple[Scheduler, OffloadScheduler]:
    """A scheduler of 16 blocks, `units` checkpoint units and a tier of ample bytes (checkpoints every 8
    tokens, the tier's chunk grid)."""
    kv = KVCacheManager(MLALatentSpec(BS, 1, 8, 2), 16, enable_prefix_caching=True)
    pc = PrefixCache(kv, CheckpointPool(units, unit_bytes=64, image_bytes=64), 8, kernel_chunk=8, offload_chunk=CHUNK)
    offload = OffloadScheduler(TierIndex(1000, CHUNK, BS, 1, 1), max_pending_saves=max_pending_saves)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=64,
                             offload_admission=admission)
    s = Scheduler(config, kv, StateSlotPool(4), pc, offload=offload)
    return s, offload


def _one_request_in_the_tier() -> tuple[Scheduler, OffloadScheduler, Request]:
    """A scheduler whose tier index lists the first 16 tokens of a 20-token prompt (HBM holds nothing)."""
    s, offload = _scheduler_with_tier(units=2, max_pending_saves=2, budget=32)
    request = Request("r", list(range(20)), 4, (-1,))
    for h in offload.index.chunk_hashes(s.prefix_cache.block_hashes(request)):
        offload.index.add_kv(h)
        offload.index.add_state(h)
    s.add_request(request)
    return s, offload, request


def test_a_tier_hit_waits_for_its_load_and_an_abort_meanwhile_frees_everything():
    s, offload, request = _one_request_in_the_tier()
    out = s.schedule()
    (load,) = out.offload_metadata.loads
    assert not out.chunks and request.status == RequestStatus.WAITING_FOR_TIER_LOAD
    assert len(load.kv_chunks) == 2 and all(len(c.block_ids) == CHUNK // BS for c in load.kv_chunks)
    s.check_invariants()
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 16 and s.state_pool.num_free == 4
    s.update_from_output(out, {}, offload_output=OffloadOutput(loads_done=["r"]))  # the late report
    s.check_invariants()
    assert not offload.has_pending and not s.has_unfinished_requests()


def test_a_finished_load_runs_from_the_hit_and_a_failed_one_recomputes_without_the_tier():
    for outcome in ("done", "failed"):
        s, offload, request = _one_request_in_the_tier()
        out = s.schedule()
        report = OffloadOutput(loads_done=["r"]) if outcome == "done" else OffloadOutput(loads_failed={"r": "lost"})
        s.update_from_output(out, {}, offload_output=report)
        s.check_invariants()
        nxt = s.schedule()
        (chunk,) = nxt.chunks
        if outcome == "done":
            assert request.num_cached_tokens == 16 and chunk.num_computed_tokens == 16
            assert s.kv_cache_manager.pool.cached_block(s.prefix_cache.block_hashes(request)[3]) is not None
        else:
            assert request.tier_load_failed and chunk.num_computed_tokens == 0
            assert nxt.offload_metadata is None or not nxt.offload_metadata.loads
            assert offload.index.stats.forgotten == 3  # its two KV chunks and the image


def test_saves_beyond_the_bound_are_deferred_and_stored_later():
    """With one save in flight at a time most saves find the bound full: they are deferred, and those
    whose checkpoint and KV HBM still holds are stored by a later step (outputs stay right)."""
    skipped = dropped = 0
    for seed in range(4):
        specs = repeated(workload(seed))
        reference = run(specs, depth=1, caching=False, num_blocks=28, units=0, budget=24)
        got, _, offload = run_with_tier(specs, 2, 28, units=2, budget=16, rng=random.Random(seed), loss=0.0,
                                        max_pending=1)
        for rid, (tokens, reason) in got.items():
            if "abort" not in (reason, reference[rid][1]):
                assert (tokens, reason) == reference[rid], rid
        skipped += offload.stats.saves_skipped
        dropped += offload.stats.saves_dropped
    assert skipped > dropped > 0  # some deferred saves were stored, some were gone from HBM first


def test_the_bound_on_saves_in_flight_defers_saves_and_never_cuts_a_chunk():
    """A cold prompt with three checkpoints on its way runs as one chunk under a bound of one save in
    flight: one save is planned with the chunk, the other two are deferred and stored by the steps after
    its report, while HBM still holds their checkpoints."""
    s, offload = _scheduler_with_tier(units=4, max_pending_saves=1, budget=64)
    s.add_request(Request("r", list(range(30)), 1, (-1,)))
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.num_tokens == 30 and [n for n, _ in chunk.state_captures] == [8, 16, 24]
    (save,) = out.offload_metadata.saves_after
    assert offload.stats.saves_skipped == 2 and offload.num_pending_saves == 1
    s.update_from_output(out, {"r": 7}, offload_output=OffloadOutput())
    stored = [save.save_id]
    for _ in range(2):  # each report frees the slot for one deferred save, stored before the next forward
        out = s.schedule()
        s.update_from_output(out, {}, offload_output=OffloadOutput(saves_done=stored[-1:]))
        out = s.schedule()
        (deferred,) = out.offload_metadata.saves_before
        stored.append(deferred.save_id)
        s.update_from_output(out, {}, offload_output=OffloadOutput())
        s.check_invariants()
    s.update_from_output(s.schedule(), {}, offload_output=OffloadOutput(saves_done=stored[-1:]))
    assert offload.stats.saves_done == 3 and offload.stats.saves_dropped == 0 and not offload.has_pending
    assert offload.index.snapshot()["state_images"] == 3


def test_cache_control_admission_saves_only_hinted_requests():
    """Under the cache_control admission a request without the hint files its checkpoints in HBM but
    saves nothing to the tier; one with it saves as under "all". Nothing is held at the end."""
    hint = SamplingParams(max_tokens=1, extra_args={"cache_control": {"type": "ephemeral"}})
    for admission, params, expect_saves in (("cache_control", None, 0), ("cache_control", hint, 2),
                                            ("all", None, 2)):
        s, offload = _scheduler_with_tier(units=4, max_pending_saves=4, budget=64, admission=admission)
        request = Request("r", list(range(20)), 1, (-1,), sampling_params=params)
        s.add_request(request)
        saves = 0
        while s.has_unfinished_requests() or offload.has_pending or s.has_pending_saves:
            out = s.schedule()
            meta = out.offload_metadata
            planned = [] if meta is None else meta.saves_before + meta.saves_after
            saves += len(planned)
            sampled = {c.request_id: 7 for c in out.chunks if c.sample}
            s.update_from_output(out, sampled, offload_output=OffloadOutput(saves_done=[p.save_id for p in planned]))
            s.check_invariants()
        assert (saves, offload.index.snapshot()["state_images"] > 0) == (expect_saves, expect_saves > 0), admission
        assert s.kv_cache_manager.pool.cached_block(s.prefix_cache.block_hashes(request)[1]) is not None
        assert s.state_pool.num_free == 4
