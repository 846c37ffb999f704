"""The scheduler on its own: budgets, chunking, admission, preemption, stops, aborts. Exact expectations."""

from __future__ import annotations

import pytest

from deltaserve.core.kv_cache_manager import KVCacheManager
from deltaserve.core.kv_cache_spec import MLALatentSpec
from deltaserve.core.request import Request, RequestStatus
from deltaserve.core.scheduler import Scheduler, SchedulerConfig
from deltaserve.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from deltaserve.core.state_pool import StateSlotPool

EOS = 99


def make_scheduler(num_blocks=64, slots=8, max_num_seqs=8, budget=16, max_model_len=128, block_size=4):
    spec = MLALatentSpec(block_size=block_size, num_layers=1, latent_dim=8, dtype_bytes=2)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return Scheduler(config, KVCacheManager(spec, num_blocks), StateSlotPool(slots))


def make_request(request_id, num_prompt, max_tokens=4, **kw):
    return Request(request_id, list(range(1, num_prompt + 1)), max_tokens, eos_token_ids=(EOS,), **kw)


def run_step(scheduler, token=7):
    out = scheduler.schedule()
    sampled = {c.request_id: token for c in out.chunks if c.sample}
    return out, scheduler.update_from_output(out, sampled).finished


def assert_all_free(scheduler):
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert scheduler.state_pool.num_free == scheduler.state_pool.num_slots


def test_chunked_prefill_then_decode():
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 19, max_tokens=2))
    out, _ = run_step(s)
    (c,) = out.chunks
    assert (c.num_computed_tokens, c.token_ids, c.new_block_ids, c.table_reset, c.sample) == (
        0, list(range(1, 9)), [0, 1], True, False)
    assert [n.request_id for n in out.new_requests] == ["a"]
    out, _ = run_step(s)
    assert out.chunks[0].num_computed_tokens == 8 and out.chunks[0].new_block_ids == [2, 3]  # only what is new
    assert not out.chunks[0].table_reset
    assert out.new_requests == []
    out, _ = run_step(s)
    c = out.chunks[0]
    assert (c.num_computed_tokens, c.token_ids, c.sample, c.new_block_ids) == (16, [17, 18, 19], True, [4])
    out, finished = run_step(s)
    c = out.chunks[0]
    assert (c.num_computed_tokens, c.token_ids, c.sample, c.num_output_tokens) == (19, [7], True, 1)
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].status == RequestStatus.FINISHED_LENGTH and finished[0].output_token_ids == [7, 7]
    assert_all_free(s)
    out = s.schedule()
    assert out.finished_request_ids == ["a"] and not out.chunks


def test_decodes_and_prefill_share_a_step():
    s = make_scheduler(budget=6)
    s.add_request(make_request("a", 3, max_tokens=8))
    run_step(s)
    s.add_request(make_request("b", 10))
    out, _ = run_step(s)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 5)]
    assert out.num_scheduled_tokens == 6


def test_max_num_seqs_and_fcfs():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for name in "abc":
        s.add_request(make_request(name, 2, max_tokens=1))
    out, finished = run_step(s)
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    assert {r.request_id for r in finished} == {"a", "b"}
    out, _ = run_step(s)
    assert [c.request_id for c in out.chunks] == ["c"]
    assert_all_free(s)


def test_state_slots_limit_admission():
    s = make_scheduler(slots=1, budget=100)
    s.add_request(make_request("a", 2, max_tokens=2))
    s.add_request(make_request("b", 2, max_tokens=2))
    out, _ = run_step(s)
    assert [c.request_id for c in out.chunks] == ["a"] and s.num_waiting == 1


def test_preemption_by_recompute():
    # 3 blocks of 4 tokens: a and b each take one block, then need a second while decoding
    s = make_scheduler(num_blocks=3, budget=100)
    s.add_request(make_request("a", 4, max_tokens=6))
    s.add_request(make_request("b", 4, max_tokens=6))
    run_step(s)
    out, _ = run_step(s)  # both need block 2 for token 5: b is preempted
    assert out.preempted_request_ids == ["b"] and [c.request_id for c in out.chunks] == ["a"]
    b = s.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert s.num_preemptions_total == 1
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        for c in out.chunks:
            if c.request_id == "b" and c.num_computed_tokens == 0:
                assert c.token_ids == [1, 2, 3, 4, 7]  # prompt plus the token it had generated
    assert_all_free(s)


def test_stop_conditions():
    s = make_scheduler(budget=100)
    s.add_request(make_request("eos", 2, max_tokens=10))
    s.add_request(make_request("stop-id", 2, max_tokens=10, stop_token_ids=(5,)))
    s.add_request(make_request("ignore", 2, max_tokens=2, ignore_eos=True))
    s.add_request(make_request("min", 2, max_tokens=10, min_tokens=2))
    out = s.schedule()
    finished = s.update_from_output(out, {"eos": EOS, "stop-id": 5, "ignore": EOS, "min": EOS}).finished
    got = {r.request_id: (r.status, r.stop_reason) for r in finished}
    assert got == {"eos": (RequestStatus.FINISHED_STOPPED, None), "stop-id": (RequestStatus.FINISHED_STOPPED, 5)}
    out = s.schedule()
    finished = s.update_from_output(out, {"ignore": EOS, "min": EOS}).finished
    assert {r.request_id: r.finish_reason for r in finished} == {"ignore": "length", "min": "stop"}


def test_max_model_len_stops():
    s = make_scheduler(budget=100, max_model_len=6)
    s.add_request(make_request("a", 4, max_tokens=100))
    _, finished = run_step(s)
    assert not finished
    _, finished = run_step(s)
    assert finished[0].finish_reason == "length" and finished[0].num_tokens == 6


def test_abort_running_and_waiting_frees_everything():
    s = make_scheduler(max_num_seqs=1, budget=100)
    s.add_request(make_request("a", 9))
    s.add_request(make_request("b", 9))
    out = s.schedule()
    s.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    update = s.update_from_output(out, {"a": 3})
    assert update.finished == [] and update.applied == set()  # aborted while in flight: nothing applied
    assert not s.has_unfinished_requests()
    assert_all_free(s)
    assert s.schedule().finished_request_ids == ["a"]  # b was never announced to the workers
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)


def test_duplicate_request_id_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", 2))
    with pytest.raises(ValueError, match="'a'"):
        s.add_request(make_request("a", 2))


def test_a_preempted_request_waits_for_room_to_spare_before_it_is_readmitted():
    """Hysteresis: four 21-token requests on 6 blocks of 4. A preempted request comes back only with a
    block to spare for each running one, so it is not preempted again at once: 3 preemptions
    (readmitting as soon as its own blocks fit took 9)."""
    s = make_scheduler(num_blocks=6, budget=8)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 12, max_tokens=9))
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        for request_id in out.preempted_request_ids:
            assert s.get_request(request_id).status == RequestStatus.PREEMPTED
        s.check_invariants()
    assert s.num_preemptions_total == 3
    assert_all_free(s)


def test_decodes_run_ahead_on_placeholders_within_the_length_limit():
    s = make_scheduler(budget=100)
    s.add_request(make_request("a", 5, max_tokens=3))
    first = s.schedule()  # the prompt, sampling token 1
    second = s.schedule()  # decodes on token 1 before it is known
    (c,) = second.chunks
    assert (c.token_ids, c.num_computed_tokens, c.num_output_tokens, c.sample) == ([PLACEHOLDER_TOKEN_ID], 5, 1, True)
    assert s.get_request("a").num_pending_outputs == 2
    s.check_invariants()
    s.update_from_output(first, {"a": 7})
    third = s.schedule()  # token 3 is the last max_tokens allows: no step runs ahead of it
    assert third.chunks[0].token_ids == [PLACEHOLDER_TOKEN_ID] and third.chunks[0].num_output_tokens == 2
    fourth = s.schedule()
    assert not fourth.chunks
    s.update_from_output(second, {"a": 8})
    finished = s.update_from_output(third, {"a": 9}).finished
    assert [r.output_token_ids for r in finished] == [[7, 8, 9]]
    s.update_from_output(fourth, {})
    s.check_invariants()
    assert_all_free(s)


def test_a_late_sample_of_an_earlier_life_is_not_applied():
    s = make_scheduler(budget=100)
    s.add_request(make_request("a", 5, max_tokens=8))
    first = s.schedule()
    s._preempt(s.get_request("a"))  # as a later schedule() does when blocks run out
    update = s.update_from_output(first, {"a": 7})
    assert update.applied == set() and s.get_request("a").output_token_ids == []
    s.check_invariants()


def prompt_targets(outs, request_id):
    """(num_computed_tokens, start, target ids) of each chunk of `request_id` that has targets."""
    return [(c.num_computed_tokens, c.prompt_logprob_targets.start, c.prompt_logprob_targets.token_ids)
            for o in outs for c in o.chunks if c.request_id == request_id and c.prompt_logprob_targets is not None]


def test_prompt_logprob_targets_follow_the_chunks():
    """Each chunk names the prompt tokens after its rows; a chunk ending inside the prompt names the
    next chunk's first token; the last prompt row samples instead; decodes name none."""
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 19, max_tokens=3, prompt_logprobs=True))  # prompt tokens 1..19
    s.add_request(make_request("plain", 5, max_tokens=2))
    outs = [run_step(s)[0] for _ in range(6)]
    assert prompt_targets(outs, "a") == [(0, 0, list(range(2, 10))), (8, 0, list(range(10, 18))), (16, 0, [18, 19])]
    assert prompt_targets(outs, "plain") == []
    assert not s.has_unfinished_requests()
    s.add_request(make_request("one", 1, max_tokens=1, prompt_logprobs=True))  # nothing before its only token
    assert prompt_targets([run_step(s)[0]], "one") == []


def test_prompt_logprob_targets_are_scheduled_once_across_a_preemption():
    # 3 blocks of 4: b is preempted after its first chunk; recomputed from 0, it names only what is left
    s = make_scheduler(num_blocks=3, budget=6)
    s.add_request(make_request("a", 4, max_tokens=6))
    s.add_request(make_request("b", 10, max_tokens=2, prompt_logprobs=True))
    outs = []
    while s.has_unfinished_requests():
        outs.append(run_step(s)[0])
        s.check_invariants()
    assert any("b" in o.preempted_request_ids for o in outs)
    targets = prompt_targets(outs, "b")
    assert targets[0] == (0, 0, [2, 3])
    assert targets[1][:2] == (0, 2)  # the second life starts at 0 but owes only the rows from 2 on
    assert [t for _, _, ids in targets for t in ids] == list(range(2, 11))  # each prompt token once, in order
    assert_all_free(s)


def test_prefill_tokens_are_bounded_while_requests_decode():
    """max_prefill_tokens_with_decodes: a step that decodes takes at most that many prefill tokens (a long
    prompt's chunks shrink while others decode, and take the whole budget when nothing decodes)."""
    from deltaserve.core.kv_cache_manager import KVCacheManager
    from deltaserve.core.kv_cache_spec import MLALatentSpec
    from deltaserve.core.request import Request
    from deltaserve.core.scheduler import Scheduler, SchedulerConfig
    from deltaserve.core.state_pool import StateSlotPool

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                             max_prefill_tokens_with_decodes=16)
    s = Scheduler(config, KVCacheManager(MLALatentSpec(16, 1, 8, 2), 64), StateSlotPool(8))
    s.add_request(Request("short", [1, 2, 3], max_tokens=20))
    out = s.schedule()  # nothing decodes yet: the short prompt whole
    s.update_from_output(out, {"short": 7})
    s.add_request(Request("long", list(range(1, 201)), max_tokens=2))
    spans = []
    for _ in range(4):
        out = s.schedule()
        spans.append({c.request_id: c.num_tokens for c in out.chunks})
        s.update_from_output(out, {c.request_id: 7 for c in out.chunks if c.sample})
        s.check_invariants()
    assert spans == [{"short": 1, "long": 16}] * 4
    alone = Scheduler(config, KVCacheManager(MLALatentSpec(16, 1, 8, 2), 64), StateSlotPool(8))
    alone.add_request(Request("long", list(range(1, 201)), max_tokens=2))
    assert [c.num_tokens for c in alone.schedule().chunks] == [64]  # nothing decodes: the whole budget
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=-1)
