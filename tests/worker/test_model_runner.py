"""The model runner under async scheduling: placeholder tokens filled in on the device, non-blocking
execute, device-resident block tables. The scenario drives a Worker on random:tiny with hand-built
scheduler outputs: prefills, chunked prefill, decodes crossing a block boundary, a finished request
whose table row a new one reuses."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest
import torch

from deltaserve.config.engine_config import EngineConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    PromptLogprobTargets,
    ScheduledChunk,
    SchedulerOutput,
)
from deltaserve.model_files.presets import preset_config
from deltaserve.sampling_params import SamplingParams
from deltaserve.worker.block_tables import BlockTables
from deltaserve.worker.model_runner import is_decode
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput, TokenLogprobs
from deltaserve.worker.worker import Worker, _decode_is_capturable

BLOCK_SIZE = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_worker(device: str = "cpu", dtype: str = "float32", enforce_eager: bool = True) -> Worker:
    config = EngineConfig(model="random:tiny", device=device, dtype=dtype, block_size=BLOCK_SIZE,
                          enforce_eager=enforce_eager, max_num_seqs=4, max_model_len=256)
    worker = Worker(config, preset_config("tiny"), "random:tiny")
    worker.load_model()
    worker.initialize_cache(CachePlan(num_blocks=32, num_state_slots=8, kv_bytes=0, state_bytes=0))
    return worker


def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    return {rid: torch.randint(3, 500, (n,), generator=gen).tolist() for rid, n in
            (("a", 31), ("b", 7), ("c", 40), ("d", 5))}


PARAMS = {
    "a": SamplingParams(temperature=0.0, logprobs=3, max_tokens=64, ignore_eos=True),
    "b": SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=64, ignore_eos=True),  # seeded draws
    "c": SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
    "d": SamplingParams(temperature=0.0, logprobs=2, max_tokens=64, ignore_eos=True),
}


def scenario(token: Callable[[str], int]) -> Iterator[SchedulerOutput]:
    """Six steps; `token(request_id)` is the decode input: the request's last sampled id, or a
    placeholder. Lazy, so a caller can look up step k's output before step k + 1 is built."""
    p = prompts()

    def chunk(rid, tokens, done, blocks, reset, slot, sample, n_out):
        return ScheduledChunk(rid, tokens, done, blocks, reset, slot, sample, n_out)

    def decode(rid, done, slot, n_out, blocks=()):
        return chunk(rid, [token(rid)], done, list(blocks), False, slot, True, n_out)

    def step(i, chunks, new=(), finished=()):
        new_requests = [NewRequestData(r, p[r], PARAMS[r]) for r in new]
        return SchedulerOutput(i, chunks, new_requests, list(finished),
                               num_scheduled_tokens=sum(c.num_tokens for c in chunks))

    yield step(0, [chunk("a", p["a"], 0, [3, 9], True, 0, True, 0),
                   chunk("b", p["b"], 0, [7], True, 1, True, 0)], new="ab")
    yield step(1, [decode("a", 31, 0, 1), decode("b", 7, 1, 1),
                   chunk("c", p["c"][:24], 0, [1, 12], True, 2, False, 0)], new="c")  # c: chunked prefill
    yield step(2, [decode("a", 32, 0, 2, blocks=[4]), decode("b", 8, 1, 2),  # a: into a new block
                   chunk("c", p["c"][24:], 24, [5], False, 2, True, 0)])
    yield step(3, [decode("a", 33, 0, 3), decode("b", 9, 1, 3), decode("c", 40, 2, 1)])
    yield step(4, [decode("a", 34, 0, 4), decode("c", 41, 2, 2),
                   chunk("d", p["d"], 0, [8], True, 1, True, 0)], new="d", finished="b")  # d: b's row
    yield step(5, [decode("a", 35, 0, 5), decode("c", 42, 2, 3), decode("d", 5, 1, 1)])


def run_with_real_tokens(worker: Worker, non_block: bool = False) -> list[ModelRunnerOutput]:
    """Each step waits for the last one's output and sends the ids it sampled."""
    outputs: list[ModelRunnerOutput] = []
    latest: dict[str, int] = {}
    for step in scenario(latest.__getitem__):
        out = worker.execute_model(step, non_block)
        if non_block:
            assert isinstance(out, AsyncModelRunnerOutput)
            out = out.get_output()
        assert isinstance(out, ModelRunnerOutput)
        outputs.append(out)
        latest.update(out.sampled_by_request())
    return outputs


def run_with_placeholders(worker: Worker,
                          execute: Callable[[Worker, SchedulerOutput], AsyncModelRunnerOutput] | None = None,
                          ) -> list[ModelRunnerOutput]:
    """Every decode sends a placeholder and every step is queued before any output is read."""
    execute = execute or (lambda w, step: w.execute_model(step, non_block=True))
    handles = [execute(worker, step) for step in scenario(lambda _: PLACEHOLDER_TOKEN_ID)]
    return [h.get_output() for h in handles]


def test_placeholders_give_the_real_tokens_outputs():
    real = run_with_real_tokens(make_worker())
    filled = run_with_placeholders(make_worker())
    assert [o.request_ids for o in real] == [["a", "b"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c"],
                                            ["a", "c", "d"], ["a", "c", "d"]]
    assert filled == real  # ids and logprobs, bit for bit
    assert real[2].logprobs[0] is not None and len(real[2].logprobs[0].token_ids) == 4


def test_non_block_on_cpu_is_ready_and_the_same():
    assert run_with_real_tokens(make_worker(), non_block=True) == run_with_real_tokens(make_worker())


def test_placeholder_without_a_sampled_token_names_the_request():
    worker = make_worker()
    steps = scenario(lambda _: PLACEHOLDER_TOKEN_ID)
    worker.execute_model(next(steps))
    p = prompts()["c"]
    # c's first chunk does not sample: its next chunk cannot start from a placeholder
    worker.execute_model(SchedulerOutput(1, [ScheduledChunk("c", p[:24], 0, [1, 12], True, 2, False, 0)],
                                         [NewRequestData("c", p, PARAMS["c"])]))
    with pytest.raises(RuntimeError, match="^c: .*PLACEHOLDER_TOKEN_ID"):
        worker.execute_model(SchedulerOutput(2, [ScheduledChunk("c", [PLACEHOLDER_TOKEN_ID], 24, [], False, 2,
                                                                True, 0)]))
    # a sampled in step 0, then was preempted: readmitted, its table and sampled id are gone
    worker.execute_model(SchedulerOutput(3, [], preempted_request_ids=["a"]))
    with pytest.raises(RuntimeError, match="^a: "):
        worker.execute_model(SchedulerOutput(4, [ScheduledChunk("a", [PLACEHOLDER_TOKEN_ID], 31, [3, 9], True,
                                                                0, True, 1)]))


def test_mirrored_tables_match_the_host_tables():
    """The device mirror (here on the CPU), kept by scattering only new ids, matches the host table
    through growth in rows and width, resets and row reuse; so do the gathers read from it."""
    gen = torch.Generator().manual_seed(0)
    plain, mirrored = BlockTables(rows=2, width=2), BlockTables(rows=2, width=2, mirror=True)
    live: set[str] = set()
    next_id = itertools.count()
    for _ in range(40):
        chunks = []
        for i in range(6):
            rid = f"r{i}"
            roll = torch.rand((), generator=gen).item()
            if rid in live and roll < 0.15:
                live.discard(rid)
                plain.drop([rid])
                mirrored.drop([rid])
                continue
            reset = rid not in live or roll < 0.25
            count = int(torch.randint(0, 4 if reset else 2, (), generator=gen)) + reset
            chunks.append(ScheduledChunk(rid, [1], 0, [next(next_id) for _ in range(count)], reset, 0, False, 0))
            live.add(rid)
        for c in chunks:
            assert plain.apply(c) == mirrored.apply(c)
        assert plain.pending() == ([], [])
        index, ids = mirrored.pending()
        mirrored.write_pending(torch.tensor(index, dtype=torch.long), torch.tensor(ids, dtype=torch.long))
        for rid in live:
            row, n = mirrored.row(rid), mirrored.num_blocks(rid)
            assert mirrored.device_table[row, :n].tolist() == plain.ids(rid) == mirrored.ids(rid)
            assert mirrored.blocks(row, n).tolist() == plain.ids(rid)
        rows = torch.tensor(sorted(mirrored.row(r) for r in live), dtype=torch.long)
        width = max(plain.lengths[r] for r in rows.tolist())
        got, want = mirrored.gather(rows, width), plain.gather(rows, width)
        for i, r in enumerate(rows.tolist()):
            n = plain.lengths[r]
            assert got[i, :n].tolist() == want[i, :n].tolist()
        positions = torch.tensor([plain.lengths[r] * BLOCK_SIZE - 1 for r in rows.tolist()], dtype=torch.long)
        assert torch.equal(mirrored.slot_mapping(rows, positions, BLOCK_SIZE),
                           plain.slot_mapping(rows, positions, BLOCK_SIZE))


@cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_decode_queues_without_host_sync_and_placeholders_match(enforce_eager):
    """Decode-only steps with placeholders are queued behind a long GPU sleep with sync debugging set
    to error: execute must return before the sleep ends. Outputs equal the real-token run's."""
    reference = run_with_real_tokens(make_worker("cuda", "bfloat16", enforce_eager))
    worker = make_worker("cuda", "bfloat16", enforce_eager)
    # without the sync-free grouped MoE (bf16 on sm90+) the model itself syncs (and captures no graphs)
    check_syncs = _decode_is_capturable(worker.model)
    assert enforce_eager or (worker.runner.decode_graphs is not None) == check_syncs
    checked = []

    def execute(w: Worker, step: SchedulerOutput) -> AsyncModelRunnerOutput:
        if not (check_syncs and all(is_decode(c) for c in step.chunks)):
            return w.execute_model(step, non_block=True)
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the step
        slept = torch.cuda.Event()
        slept.record()
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = w.execute_model(step, non_block=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(handle, AsyncModelRunnerOutput)
        assert not slept.query(), "execute waited for the GPU"
        checked.append(step.step_id)
        return handle

    filled = run_with_placeholders(worker, execute)
    assert checked == ([3, 5] if check_syncs else [])
    assert [o.request_ids for o in filled] == [o.request_ids for o in reference]
    assert [o.sampled_token_ids for o in filled] == [o.sampled_token_ids for o in reference]
    for got, want in zip(filled, reference, strict=True):
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert (g is None) == (w is None)
            if g is not None:
                assert g.token_ids == w.token_ids and g.rank == w.rank
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)


def prompt_logprob_steps(spans: list[tuple[int, int]], non_block: bool = False,
                         worker: Worker | None = None) -> dict[int, TokenLogprobs]:
    """Prompt c computed in chunks [start, end) on a fresh worker (by default a CPU one), every chunk
    asking for the logprobs of the prompt tokens after its rows: {prompt position: its TokenLogprobs}."""
    worker, p = worker or make_worker(), prompts()["c"]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    got: dict[int, TokenLogprobs] = {}
    for step_id, (start, end) in enumerate(spans):
        targets = PromptLogprobTargets(0, p[start + 1 : min(end, len(p) - 1) + 1])
        chunk = ScheduledChunk("c", p[start:end], start, [1, 12, 5] if start == 0 else [], start == 0, 2,
                               end == len(p), 0, targets)
        new = [NewRequestData("c", p, params)] if start == 0 else []
        out = worker.execute_model(SchedulerOutput(step_id, [chunk], new), non_block)
        out = out.get_output() if non_block else out
        assert out.request_ids == (["c"] if end == len(p) else [])  # only the last chunk samples
        step = out.prompt_logprobs["c"]
        assert step.first_position == start + 1 and len(step.entries) == len(targets.token_ids)
        got.update((step.first_position + i, e) for i, e in enumerate(step.entries))
    return got


def test_prompt_logprobs_of_chunks_equal_the_whole_prompt():
    """Chunked prefill (one chunk of a single token, which the runner treats as a decode) gives the
    whole prompt's prompt logprobs; each is the prompt token's, with its rank and the top 2."""
    p = prompts()["c"]
    whole = prompt_logprob_steps([(0, 40)])
    assert sorted(whole) == list(range(1, 40))
    for position, entry in whole.items():
        assert entry.token_ids[0] == p[position] and len(entry.token_ids) == len(entry.logprobs) == 3
        assert entry.rank >= 1 and entry.logprobs[1] >= entry.logprobs[2] and entry.logprobs[1] >= entry.logprobs[0]
    for spans, non_block in (([(0, 24), (24, 25), (25, 40)], False), ([(0, 7), (7, 40)], True)):
        chunked = prompt_logprob_steps(spans, non_block)
        assert sorted(chunked) == sorted(whole)
        for position, entry in chunked.items():
            assert entry.token_ids[0] == whole[position].token_ids[0] and entry.rank == whole[position].rank
            assert entry.logprobs == pytest.approx(whole[position].logprobs, abs=1e-5)


@cuda
def test_cuda_prompt_logprobs_come_back_by_the_non_blocking_copy():
    """On the GPU, prompt logprobs come back with the sampled ids by the pinned non-blocking copy,
    as the blocking path gives them; a lone one-token prompt chunk runs in a decode graph, whose
    logits rows give its prompt logprob as the eager forward does."""
    spans = [(0, 24), (24, 25), (25, 40)]
    cpu = prompt_logprob_steps(spans)
    blocking = prompt_logprob_steps(spans, worker=make_worker("cuda"))
    queued = prompt_logprob_steps(spans, non_block=True, worker=make_worker("cuda"))
    assert sorted(queued) == sorted(blocking) == sorted(cpu)
    for position, entry in queued.items():
        assert entry.token_ids[0] == blocking[position].token_ids[0] == cpu[position].token_ids[0]
        assert entry.logprobs == pytest.approx(blocking[position].logprobs, abs=1e-5)
        assert entry.logprobs[0] == pytest.approx(cpu[position].logprobs[0], abs=2e-2)
    graphed_worker = make_worker("cuda", "bfloat16", enforce_eager=False)
    if graphed_worker.runner.decode_graphs is None:
        pytest.skip("no decode graphs on this GPU (the sync-free grouped MoE needs bf16 on sm90+)")
    eager = prompt_logprob_steps(spans, True, make_worker("cuda", "bfloat16", enforce_eager=True))
    graphed = prompt_logprob_steps(spans, True, graphed_worker)
    assert sorted(graphed) == sorted(eager)
    for position, entry in graphed.items():
        assert entry.token_ids[0] == eager[position].token_ids[0]
        assert entry.logprobs[0] == pytest.approx(eager[position].logprobs[0], abs=5e-2)
