"""The Eagle3 drafter through the engine: a random head over the tiny target is lossless (greedy tokens of
plain decoding) with prefix caching and chunked prefill; under PP=2 and PP=4 the tap states of earlier
stages are relayed with the stream, stages that own no tap included; a relay of the wrong width is refused;
the head's vocabulary, width and taps are checked against the target at startup."""

from __future__ import annotations

import pytest
import torch
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.eagle3 import random_eagle3_head, save_eagle3
from deltaserve.model.kimi_linear import IntermediateTensors, KimiLinearForCausalLM

from .test_spec_engine import assert_nothing_held

COMMON = {"dtype": "float32", "device": "cpu", "block_size": 16, "max_num_batched_tokens": 48, "num_kv_blocks": 32}
# KDA, KDA, MLA, KDA, KDA, MLA, KDA, KDA: PP=4 gives every stage a KDA layer; the default taps (2, 4, 5)
# sit on stages 1 and 2, none on stages 0 and 3
EIGHT_LAYERS = tiny_hub_config(num_hidden_layers=8, linear_attn_config=dict(
    head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 4, 5, 7, 8], full_attn_layers=[3, 6]))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, _ = checkpoint_dir(tmp_path_factory, "e3target", EIGHT_LAYERS, seed=61)
    head_dir = str(tmp_path_factory.mktemp("e3head"))
    config = KimiLinearConfig.from_dict(EIGHT_LAYERS)
    head = random_eagle3_head(config.vocab_size, config.hidden_size, config.num_hidden_layers, seed=3)
    assert head.config.tap_layer_ids == (2, 4, 5)
    save_eagle3(head, head_dir, torch.float32)
    return target, head_dir


def prompts():
    return random_prompts([25, 50, 11], 320, seed=17)


def greedy(n=16):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm, batch):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(dirs):
    return run(LLM(model=dirs[0], **COMMON, enable_prefix_caching=False), prompts())


def spec(head_dir, k=3):
    return {"method": "eagle3", "model": head_dir, "num_speculative_tokens": k}


@pytest.mark.parametrize("world", [{}, {"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 4}],
                         ids=["pp1", "pp2", "pp4"])
def test_eagle3_is_lossless_and_taps_cross_the_stages(dirs, reference, world):
    llm = LLM(model=dirs[0], **COMMON, **world, speculative_config=spec(dirs[1]))
    try:
        assert run(llm, prompts()) == reference
        assert run(llm, prompts()) == reference  # prefix hits: the head starts from its first tapped position
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
        assert_nothing_held(llm)
    finally:
        llm.llm_engine.shutdown()


def test_a_relay_of_the_wrong_width_is_refused():
    config = KimiLinearConfig.from_dict(EIGHT_LAYERS)
    stage = KimiLinearForCausalLM(config, ParallelConfig(pipeline_parallel_size=2, pipeline_parallel_rank=1),
                                  torch.float32)
    stage.tap_layer_ids = (2, 4, 5)  # tap 2 lives on stage 0: one hidden-size column block is expected
    hidden = torch.zeros(3, config.hidden_size)
    assert stage._relayed_taps(IntermediateTensors(hidden, hidden, torch.zeros(3, config.hidden_size)))
    for wrong in (None, torch.zeros(3, 2 * config.hidden_size)):
        with pytest.raises(RuntimeError, match="relayed"):
            stage._relayed_taps(IntermediateTensors(hidden, hidden, wrong))


def test_a_head_that_does_not_fit_the_target_is_refused(dirs, tmp_path):
    head = random_eagle3_head(320, 32, 8, seed=1)  # half the target's width
    save_eagle3(head, str(tmp_path), torch.float32)
    with pytest.raises(ValueError, match="target_hidden_size"):
        LLM(model=dirs[0], **COMMON, speculative_config=spec(str(tmp_path)))


@pytest.mark.parametrize("k", [1, 5])
def test_eagle3_k_with_chunked_prefill_preemption_and_an_abort(dirs, reference, k):
    llm = LLM(model=dirs[0], **{**COMMON, "max_num_batched_tokens": 20, "num_kv_blocks": 9},
              speculative_config=spec(dirs[1], k))
    assert run(llm, prompts()) == reference
    assert llm.get_metrics()["scheduler"]["num_preemptions"] > 0
    engine = llm.llm_engine
    engine.add_request("gone", {"prompt_token_ids": prompts()[1]}, greedy())
    for _ in range(5):
        engine.step()
    engine.abort_request(["gone"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def record_drafts(drafter) -> list:
    """A list that collects each step's proposals (sorted by request) from now on."""
    drafts, propose = [], drafter.propose

    def recording(*args):
        proposed = propose(*args)
        drafts.append(sorted(proposed.items()))
        return proposed

    drafter.propose = recording
    return drafts


def test_eagle3_taps_come_through_the_graph_layouts(dirs, reference):
    """Decode and verify steps laid out as their CUDA graphs would run them (padded, decode rows as
    one-token windows, run eagerly here) hand the drafter the tap rows of the step's own rows: every
    draft is the one the unpadded steps give."""
    from deltaserve.worker.cuda_graph import DecodeGraphs

    from .test_spec_engine import lay_out_verify_graphs

    options = {**COMMON, "max_num_batched_tokens": 10, "max_num_seqs": 4}  # a small budget cuts windows short

    def drafting(layouts):
        llm = LLM(model=dirs[0], **options, speculative_config=spec(dirs[1]))
        runner = llm.llm_engine.executor.worker.runner
        drafts = record_drafts(runner.drafter)
        served = None
        if layouts:
            served = lay_out_verify_graphs(llm, 3, sizes=(1, 2, 4))
            engine = llm.llm_engine
            decode = DecodeGraphs(runner.model, runner.device, 16, engine.config.max_model_len or 2048,
                                  engine.cache_plan.num_blocks, engine.cache_plan.num_state_slots)
            decode.lay_out_without_capture([1, 2, 4])
            runner.decode_graphs = decode
        assert run(llm, prompts()) == reference
        return drafts, served

    plain, _ = drafting(False)
    laid_out, served = drafting(True)
    assert any(decodes or len(set(lengths)) > 1 for decodes, lengths in served), served  # rows reordered
    assert laid_out == plain


def test_padded_extend_matches_one_request_at_a_time():
    """Requests with caches of different lengths and different numbers of new entries, padded into one
    call, get the outputs and entries each gets alone (float64)."""
    from deltaserve.model.eagle3 import Eagle3KVCache

    head = random_eagle3_head(40, 16, 8, seed=5).double()
    c = head.config
    lengths, counts = [0, 5, 2], [3, 1, 4]
    alone_out, caches = [], []
    width = max(counts)
    past_k = torch.zeros(3, c.num_attention_heads, max(lengths) + width, c.head_dim, dtype=torch.float64)
    past_v = torch.zeros_like(past_k)
    tokens = torch.randint(0, 40, (3, width))
    hidden = torch.randn(3, width, 16, dtype=torch.float64)
    for b, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        cache = Eagle3KVCache()
        if length:
            head(torch.randint(0, 40, (1, length)), torch.randn(1, length, 16, dtype=torch.float64),
                 torch.arange(length)[None], cache)
            past_k[b, :, :length], past_v[b, :, :length] = cache.k[0], cache.v[0]
        positions = torch.arange(length, length + count)[None]
        alone_out.append(head(tokens[b : b + 1, :count], hidden[b : b + 1, :count], positions, cache)[0])
        caches.append(cache)
    valid = torch.arange(max(lengths) + width) < torch.tensor(lengths)[:, None]
    positions = torch.tensor(lengths)[:, None] + torch.arange(width)
    out = head.extend(tokens, hidden, positions, past_k, past_v, valid, max(lengths))
    k, v = past_k[:, :, max(lengths) :], past_v[:, :, max(lengths) :]
    for b, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        torch.testing.assert_close(out[b, :count], alone_out[b], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(k[b, :, :count], caches[b].k[0, :, length:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v[b, :, :count], caches[b].v[0, :, length:], rtol=1e-12, atol=1e-12)


class OneAtATimeDrafter:
    """The drafter as it was: one head call per request for its step-0 entries, then one per draft (with a
    host sync each); the batched drafter must give the same drafts."""

    def __init__(self, head, k, max_model_len):
        from deltaserve.spec.known_tokens import KnownTokens

        self.head, self.k, self.max_model_len, self.known = head, k, max_model_len, KnownTokens()
        self.caches, self.first = {}, {}

    @torch.inference_mode()
    def propose(self, scheduler_output, output, runner):
        from deltaserve.model.eagle3 import Eagle3KVCache

        self.known.note_step(scheduler_output)
        gone = scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids
        for request_id in gone + [n.request_id for n in scheduler_output.new_requests]:
            self.caches.pop(request_id, None)
            self.first.pop(request_id, None)
        self.known.note_output(output)
        taps = runner.model.captured_taps
        if taps is None or not scheduler_output.chunks:
            return {}
        fused = self.head.fuse(taps)
        accepted = {r: 1 + len(output.extra_token_ids.get(r, [])) for r in output.request_ids}
        drafts = {}
        for chunk in scheduler_output.chunks:
            rid, start = chunk.request_id, chunk.num_computed_tokens
            count = accepted.get(rid, 0) if chunk.is_verify else chunk.num_tokens
            if count == 0:
                continue
            cache, first = self.caches.get(rid), self.first.get(rid, start)
            if cache is None or first + cache.length != start:
                cache = self.caches[rid] = Eagle3KVCache()
                self.first[rid] = start
            row = runner.step_rows[rid]
            known = self.known[rid]
            out = self.head(torch.tensor([known[start + 1 : start + 1 + count]]), fused[row : row + count][None],
                            torch.arange(start, start + count)[None], cache)[:, -1:]
            if rid not in accepted:
                continue
            kept, position, rid_drafts = cache.length, len(known) - 2, []
            n = min(self.k, self.max_model_len - len(known))
            for step in range(n):
                rid_drafts.append(int(self.head.compute_logits(out)[0, -1].argmax()))
                if step + 1 < n:
                    out = self.head(torch.tensor([[rid_drafts[-1]]]), out, torch.tensor([[position + step + 1]]), cache)
            cache.k, cache.v = cache.k[:, :, :kept], cache.v[:, :, :kept]
            drafts[rid] = rid_drafts
        return drafts


def test_batched_drafts_equal_one_request_at_a_time(dirs, reference):
    """Through the engine, with chunked prefill, verify windows and prefix hits: every step's drafts from
    the batched drafter are those of drafting one request at a time."""

    def drafting(one_at_a_time):
        llm = LLM(model=dirs[0], **{**COMMON, "max_num_batched_tokens": 20}, speculative_config=spec(dirs[1]))
        runner = llm.llm_engine.executor.worker.runner
        if one_at_a_time:
            runner.drafter = OneAtATimeDrafter(runner.drafter.head, runner.drafter.k, runner.drafter.max_model_len)
        drafts = record_drafts(runner.drafter)
        assert run(llm, prompts()) == reference
        assert run(llm, prompts()) == reference
        llm.llm_engine.shutdown()
        return drafts

    batched = drafting(False)
    assert sum(len(step) > 1 for step in batched) > 3  # several requests drafted in one step
    assert batched == drafting(True)


def test_the_heads_caches_come_out_of_the_cache_budget(dirs):
    """The same cache_memory: the target's caches shrink by the head's share (its keys and values per token,
    2.75 times over: caches grown by a quarter and the step's padded copy, against the target's latents)."""
    options = {k: v for k, v in COMMON.items() if k != "num_kv_blocks"}
    plain = LLM(model=dirs[0], **options, cache_memory="32MiB")
    drafted = LLM(model=dirs[0], **options, cache_memory="32MiB", speculative_config=spec(dirs[1]))
    try:
        worker = drafted.llm_engine.executor.worker
        head = worker.draft_weights.config
        target_kv = len(worker.model.mla_layers()) * worker.model_config.latent_dim * 4
        want = 2.75 * 2 * head.num_attention_heads * head.head_dim * 4 / target_kv
        assert worker._draft_cache_share() == pytest.approx(want) and want > 1
        blocks = plain.llm_engine.cache_plan.num_blocks, drafted.llm_engine.cache_plan.num_blocks
        assert blocks[1] < blocks[0] / (1 + want) * 1.1 and blocks[1] > 0, blocks
    finally:
        plain.llm_engine.shutdown()
        drafted.llm_engine.shutdown()


def test_padding_groups_keep_the_padded_copy_near_the_entries():
    from deltaserve.spec.eagle3_drafter import PADDING_LIMIT, PADDING_SLACK, padding_groups

    assert padding_groups([100, 90, 110]) == [[1, 0, 2]]  # similar lengths: one group, shortest first
    lengths = [1_000_000] + [1_000] * 63  # one long request beside many short ones
    groups = padding_groups(lengths)
    assert groups == [list(range(1, 64)), [0]]
    mixed = [5, 0, 7000, 300, 64, 2, 90_000, 88_000, 0, 1]
    groups = padding_groups(mixed)
    assert sorted(i for group in groups for i in group) == list(range(len(mixed)))
    for group in groups:
        members = [mixed[i] for i in group]
        assert len(group) == 1 or max(members) * len(group) <= PADDING_LIMIT * sum(members) + PADDING_SLACK



def test_a_groups_padded_entries_stay_out_of_its_drafts():
    """float64, straight into the drafter: requests with different cache lengths and numbers of new entries,
    drafted as one padded group, give the draft hidden states (so the drafts) each gets drafted alone. A
    request with fewer new entries than the group's widest pads at the end; its draft steps must not see
    those columns (the engine-level test above cannot tell: the tiny head's drafts do not move)."""
    from deltaserve.spec.eagle3_drafter import Eagle3Drafter

    head = random_eagle3_head(40, 16, 8, seed=5).double()
    generator = torch.Generator().manual_seed(11)
    fused = torch.randn(64, 16, generator=generator, dtype=torch.float64)
    tokens = {rid: torch.randint(0, 40, (30,), generator=generator).tolist() for rid in "abc"}
    # (request, first new position, new entries, first fused row), two steps of each request
    steps = [[("a", 0, 5, 0), ("b", 0, 2, 8), ("c", 0, 7, 16)], [("a", 5, 1, 24), ("b", 2, 4, 32), ("c", 7, 2, 40)]]
    seen: list[torch.Tensor] = []
    logits = head.compute_logits

    def recording(hidden):
        seen.append(hidden.clone())
        return logits(hidden)

    head.compute_logits = recording

    def drafting(rids):
        drafter = Eagle3Drafter(head, k=3, max_model_len=100)
        drafter.known.tokens = {rid: tokens[rid] for rid in rids}
        seen.clear()
        drafts = []
        for step in steps:
            entries = [entry for entry in step if entry[0] in rids]
            for rid, start, _, _ in entries:
                drafter._cache_for(rid, start)
            drafts.append(drafter._run_group(entries, fused, set(rids)))
        return drafts, torch.stack([h[:, 0] for h in seen])  # [calls, B, H]

    together, hidden = drafting("abc")
    for b, rid in enumerate("abc"):
        alone, alone_hidden = drafting(rid)
        assert [{rid: step[rid]} for step in together] == alone
        torch.testing.assert_close(hidden[:, b], alone_hidden[:, 0], rtol=1e-12, atol=1e-12)


def test_fused_projections_give_the_unfused_outputs():
    """A drafter's head multiplies q/k/v and gate/up as one GEMM each (fuse_projections): the same outputs
    and cache entries as the separate projections (float64), the state dict unchanged, one copy of the
    weights; q and k rotated together equal each rotated alone."""
    from deltaserve.model.eagle3 import Eagle3KVCache, apply_rope

    head = random_eagle3_head(40, 32, 8, head_dim=8, seed=9).double()
    fused = random_eagle3_head(40, 32, 8, head_dim=8, seed=9).double().fuse_projections()
    names = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in fused.state_dict().items()} == names
    attn = fused.midlayer.self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # views, not copies
    tokens, hidden = torch.randint(0, 40, (2, 5)), torch.randn(2, 5, 32, dtype=torch.float64)
    positions = torch.arange(3, 8).expand(2, 5)
    caches = Eagle3KVCache(), Eagle3KVCache()
    for model, cache in zip((head, fused), caches, strict=True):
        model(tokens[:, :3], hidden[:, :3], positions[:, :3], cache)
    outs = [model(tokens[:, 3:], hidden[:, 3:], positions[:, 3:], cache)
            for model, cache in zip((head, fused), caches, strict=True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-12, atol=1e-12)
    u = torch.randn(2, 5, 64, dtype=torch.float64)
    q, k, _ = head.midlayer.self_attn.qkv(u, positions)
    c = head.config
    alone_q = head.midlayer.self_attn.q_proj(u).view(2, 5, c.num_attention_heads, c.head_dim).transpose(1, 2)
    alone_k = head.midlayer.self_attn.k_proj(u).view(2, 5, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    assert torch.equal(q, apply_rope(alone_q, positions, c.rope_theta))
    assert torch.equal(k, apply_rope(alone_k, positions, c.rope_theta))
