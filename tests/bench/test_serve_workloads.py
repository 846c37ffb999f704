"""The benchmark's workloads as plain data: the trace mapper (equal ids, equal blocks), random
lengths, agentic sessions growing to their target, and settings refused by the flag's name."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from deltaserve.bench.mooncake import TraceRecord
from deltaserve.bench.serve.agentic import AgenticConfig, AgenticWorkload
from deltaserve.bench.serve.config import BenchConfig
from deltaserve.bench.serve.runner import split_evenly
from deltaserve.bench.serve.tokens import Namespace
from deltaserve.bench.serve.trace_mapper import TraceTokenMapper
from deltaserve.bench.serve.workloads import RandomConfig, RandomWorkload, TraceConfig, TraceWorkload

VOCAB = 512


def test_trace_mapper_gives_equal_blocks_for_equal_ids_only():
    mapper = TraceTokenMapper(VOCAB, Namespace(seed=0, salt=7, level=0))
    a = mapper.prompt(TraceRecord(0, 1536, 4, (1, 2, 3)))
    b = mapper.prompt(TraceRecord(0, 1400, 4, (1, 2, 4)))
    c = mapper.prompt(TraceRecord(0, 2000, 4, (1, 2, 3, 5)))
    assert len(a) == 1536 and len(b) == 1400 and len(c) == 2000
    assert a[:1024] == b[:1024] and c[:1536] == a
    assert a[1024:1400] != b[1024:1400]  # id 3 vs id 4
    assert all(0 <= t < VOCAB for t in a + b + c)
    partial = mapper.prompt(TraceRecord(0, 700, 4, (1, 9)))
    assert partial[:512] == a[:512] and partial[512:] == list(mapper.block(9))[:188]
    # the same id in another level or another run's salt is another block
    assert TraceTokenMapper(VOCAB, Namespace(0, 7, 1)).block(1) != mapper.block(1)
    assert TraceTokenMapper(VOCAB, Namespace(0, 8, 0)).block(1) != mapper.block(1)
    assert TraceTokenMapper(VOCAB, Namespace(0, 7, 0)).block(1) == mapper.block(1)  # a pure function
    assert len({mapper.block(h) for h in range(200)}) == 200


def test_trace_mapper_refuses_a_record_short_of_hash_ids():
    with pytest.raises(ValueError, match="input_length=1025 needs 3 hash_ids"):
        TraceTokenMapper(VOCAB, Namespace(0, 0, 0)).prompt(TraceRecord(5, 1025, 4, (1, 2)))


def test_trace_workload_skips_what_does_not_fit_and_scales_timestamps():
    records = [TraceRecord(1000, 600, 10, (1, 2)), TraceRecord(1500, 3000, 10, (1, 2, 3, 4, 5, 6)),
               TraceRecord(3000, 500, 900, (1,)), TraceRecord(5000, 100, 50, (7,))]
    workload = TraceWorkload(TraceConfig("t.jsonl", time_scale=0.5, max_output_len=400), VOCAB, 0, 0,
                             max_model_len=1024, records=records)
    assert workload.num_skipped == 1 and workload.size == 3 and workload.mode == "timestamps"
    specs = list(workload.requests(0))
    assert [(len(s.prompt_token_ids), s.max_tokens) for s in specs] == [(600, 10), (500, 400), (100, 50)]
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 2.0]
    concurrency = TraceWorkload(TraceConfig("t.jsonl", replay="concurrency"), VOCAB, 0, 0, None, records=records)
    assert concurrency.mode == "queue" and concurrency.num_skipped == 0


def test_random_lengths_follow_the_seed_not_the_salt():
    config = RandomConfig(input_len=100, output_len=20, range_ratio=0.5, prefix_len=8)
    first = list(itertools.islice(RandomWorkload(config, VOCAB, 3, 1, None).requests(0), 50))
    other_salt = list(itertools.islice(RandomWorkload(config, VOCAB, 3, 2, None).requests(0), 50))
    lengths = [(len(s.prompt_token_ids), s.max_tokens) for s in first]
    assert lengths == [(len(s.prompt_token_ids), s.max_tokens) for s in other_salt]
    assert first[0].prompt_token_ids != other_salt[0].prompt_token_ids
    assert all(8 + 50 <= n <= 8 + 150 and 10 <= m <= 30 for n, m in lengths) and len(set(lengths)) > 10
    assert len({tuple(s.prompt_token_ids[:8]) for s in first}) == 1  # the shared prefix
    with pytest.raises(ValueError, match="max_model_len=100"):
        RandomWorkload(config, VOCAB, 0, 0, max_model_len=100)


def _run_session(session, answer=None):
    """Turns until the session ends; the (prompt length, max_tokens) of each."""
    turns = []
    while (spec := session.next_request()) is not None:
        turns.append((len(spec.prompt_token_ids), spec.max_tokens))
        session.add_turn(answer(spec) if answer else None, spec.max_tokens)
        session.think_time()
    return turns


def test_agentic_session_grows_by_answer_and_tool_result_to_its_target():
    config = AgenticConfig(system_prompt_len=300, tool_definitions_len=200, user_prompt_len=50,
                           tool_result_len=(40, 80), answer_len=(10, 20), target_context_len=4000,
                           think_time_s=(0.5, 1.0), cache_bust_len=8)
    workload = AgenticWorkload(config, VOCAB, seed=1, salt=5, max_model_len=1024)
    assert workload.target_context_len == 1024  # capped by the server
    s0 = workload.session(0, 0)
    first = s0.next_request()
    assert len(first.prompt_token_ids) == 8 + 300 + 200 + 50 and 10 <= first.max_tokens <= 20
    answer = [3] * first.max_tokens
    s0.add_turn(answer, first.max_tokens)
    assert 0.5 <= s0.think_time() <= 1.0
    second = s0.next_request()
    grown = len(second.prompt_token_ids) - len(first.prompt_token_ids) - first.max_tokens
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.prompt_token_ids[len(first.prompt_token_ids):][:len(answer)] == answer  # the server's ids
    assert 40 <= grown <= 80 and second.turn == 2
    turns = _run_session(workload.session(0, 1))
    assert all(n + m <= 1024 for n, m in turns) and len(turns) > 3
    # the same lengths whatever the server answers and whatever the salt; tokens differ with the salt
    again = AgenticWorkload(config, VOCAB, seed=1, salt=6, max_model_len=1024)
    assert _run_session(again.session(0, 1), answer=lambda spec: [1] * spec.max_tokens) == turns
    # cache bust: the sessions share nothing from the first token; without it, the system prompt
    a, b = workload.session(0, 2).next_request(), workload.session(0, 3).next_request()
    assert a.prompt_token_ids[0:8] != b.prompt_token_ids[0:8]
    assert a.prompt_token_ids[8:508] == b.prompt_token_ids[8:508]
    shared = AgenticWorkload(AgenticConfig(**{**config.__dict__, "cache_bust": False}), VOCAB, 1, 5, 1024)
    c, d = shared.session(0, 2).next_request(), shared.session(0, 3).next_request()
    assert c.prompt_token_ids[:500] == d.prompt_token_ids[:500] == a.prompt_token_ids[8:508]


def test_settings_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--agentic-answer-len=30:20"):
        AgenticConfig(answer_len=(30, 20))
    with pytest.raises(ValueError, match="--agentic-target-context"):
        AgenticWorkload(AgenticConfig(), VOCAB, 0, 0, max_model_len=4096)  # 12.5k-token first turn
    with pytest.raises(ValueError, match="--random-range-ratio=1.5"):
        RandomConfig(range_ratio=1.5)
    with pytest.raises(ValueError, match="--trace-replay='later'"):
        TraceConfig("t.jsonl", replay="later")
    with pytest.raises(ValueError, match="--workload trace needs --trace FILE"):
        BenchConfig(workload="trace")
    with pytest.raises(ValueError, match="--concurrency"):
        BenchConfig(concurrency=[0, 4])
    with pytest.raises(ValueError, match="--num-gpus=0"):
        BenchConfig(num_gpus=0)


def test_request_limits():
    assert split_evenly(10, 4) == [3, 3, 2, 2] and split_evenly(2, 4) == [1, 1, 0, 0]
    assert BenchConfig(concurrency=[1, 8]).num_requests_at(8) == 80
    assert BenchConfig(num_requests=5).num_requests_at(8) == 5
    assert BenchConfig(duration_s=30.0).num_requests_at(8) is None


def test_agentic_cache_control_marks_every_turn_but_a_known_last():
    """--agentic-cache-control: every turn that could be followed by another carries the hint (sent as
    cache_control: {"type": "ephemeral"}); the session's last turn does not, here where the minimal next
    turn cannot fit. Off (the default), no turn carries it."""
    from deltaserve.bench.serve.client import CompletionClient

    config = AgenticConfig(system_prompt_len=300, tool_definitions_len=200, user_prompt_len=50,
                           tool_result_len=(40, 40), answer_len=(10, 10), target_context_len=1000,
                           cache_control=True)
    session = AgenticWorkload(config, VOCAB, seed=1, salt=5, max_model_len=None).session(0, 0)
    specs = []
    while (spec := session.next_request()) is not None:
        specs.append(spec)
        session.add_turn(None, spec.max_tokens)
    assert len(specs) > 2 and [s.cache_control for s in specs] == [True] * (len(specs) - 1) + [False]
    client = CompletionClient("http://127.0.0.1:1", "m")
    assert client.payload(specs[0])["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in client.payload(specs[-1])
    asyncio.run(client.__aexit__())
    plain = AgenticWorkload(AgenticConfig(**{**config.__dict__, "cache_control": False}), VOCAB, 1, 5, None)
    assert not plain.session(0, 0).next_request().cache_control
