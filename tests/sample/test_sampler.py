"""Sampler: greedy, temperature, top-k/top-p/min-p, seeded rows and logprobs against float64 references.

Fresh random logits in every test; the global RNG is seeded so failures reproduce.
"""

import pytest
import torch

from deltaserve.sample import Sampler, SamplingMetadata, step_seed
from deltaserve.sampling_params import SamplingParams

sampler = Sampler()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def sample(logits, params, seeds=None):
    seeds = seeds if seeds is not None else [None] * len(params)
    return sampler(logits, SamplingMetadata.from_params(params, seeds, logits.device))


def allowed_tokens(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Naive float64 reference of the tokens a random row may draw: one row [V]."""
    x = logits.double() / p.temperature
    order = torch.argsort(x, descending=True).tolist()
    keep = order[: p.top_k] if p.top_k > 0 else order
    probs = torch.softmax(x[keep], dim=0).tolist()
    if p.top_p < 1.0:
        mass, cut = 0.0, []
        for tok, pr in zip(keep, probs, strict=True):
            cut.append(tok)
            mass += pr
            if mass >= p.top_p:
                break
        keep = cut
    full = torch.softmax(x, dim=0)
    return {t for t in keep if full[t] >= p.min_p * full.max()}


def test_greedy_equals_argmax_and_mixes_with_random_rows():
    logits = torch.randn(16, 300) * 3
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(16)
    ]
    out = sample(logits, params).sampled_token_ids
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out[::2], logits.argmax(-1)[::2])
    all_greedy = sample(logits, [SamplingParams(temperature=0.0)] * 16).sampled_token_ids
    assert torch.equal(all_greedy, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 3.0, 50.0])
def test_top_k_1_and_tiny_top_p_equal_greedy(temperature):
    logits = torch.randn(32, 500)
    greedy = logits.argmax(-1)
    top_k = sample(logits, [SamplingParams(temperature=temperature, top_k=1)] * 32).sampled_token_ids
    top_p = sample(logits, [SamplingParams(temperature=temperature, top_p=1e-6)] * 32).sampled_token_ids
    min_p = sample(logits, [SamplingParams(temperature=temperature, min_p=1.0)] * 32).sampled_token_ids
    assert torch.equal(top_k, greedy) and torch.equal(top_p, greedy) and torch.equal(min_p, greedy)


def test_bfloat16_logits_are_sampled_in_float32():
    logits = torch.randn(8, 100).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=3)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.8, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.9, top_k=7, top_p=0.8, min_p=0.1),
    ],
    ids=["min_p=0.2", "min_p=0.05", "top_k=5", "top_p=0.6", "all_three"],
)
def test_filters_allow_exactly_the_reference_set(params):
    vocab, draws = 40, 6000
    row = torch.randn(vocab) * 1.5
    allowed = allowed_tokens(row, params)
    assert 1 < len(allowed) < vocab
    seen = set(sample(row.expand(draws, vocab), [params] * draws).sampled_token_ids.tolist())
    assert seen <= allowed, f"drew filtered tokens {sorted(seen - allowed)}"
    # every allowed token with probability >= 1% (renormalised) appears in 6000 draws
    x = row.double() / params.temperature
    kept = torch.tensor(sorted(allowed))
    probs = torch.softmax(x[kept], dim=0)
    likely = {int(t) for t, pr in zip(kept, probs, strict=True) if pr >= 0.01}
    assert likely <= seen


def test_temperature_distribution_matches_softmax():
    vocab, draws, temperature = 6, 30000, 0.7
    row = torch.randn(vocab)
    out = sample(row.expand(draws, vocab), [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    expected = torch.softmax(row.double() / temperature, dim=0) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 35.0, f"chi-square {chi2:.1f} with {vocab - 1} dof; counts {counts.tolist()}"


def test_seeded_rows_are_reproducible_and_batch_independent():
    vocab = 1000
    params = SamplingParams(temperature=1.0, top_k=200, top_p=0.95, seed=1)
    tokens = []
    for request_seed in range(40):
        row = torch.randn(vocab)
        seed = step_seed(request_seed, 3)
        alone = sample(row[None], [params], [seed]).sampled_token_ids.item()
        again = sample(row[None], [params], [seed]).sampled_token_ids.item()
        others = torch.randn(6, vocab)
        batch = torch.cat([others[:3], row[None], others[3:]])
        batch_params = [
            SamplingParams(temperature=1.5),
            SamplingParams(temperature=0.0),
            params,
            params,
            SamplingParams(temperature=0.5, min_p=0.1),
            params,
            SamplingParams(),
        ]
        batch_seeds = [None, None, step_seed(99, 0), seed, None, step_seed(7, 1), None]
        in_batch = sample(batch, batch_params, batch_seeds).sampled_token_ids[3].item()
        assert alone == again == in_batch
        tokens.append(alone)
    assert len(set(tokens)) > 20  # different seeds and logits give different draws


def test_same_logits_different_step_seeds_differ():
    row = torch.zeros(1, 5000)  # uniform: every draw is the seed's alone
    params = [SamplingParams(temperature=1.0, seed=5)]
    draws = {sample(row, params, [step_seed(5, i)]).sampled_token_ids.item() for i in range(30)}
    assert len(draws) > 25


def test_step_seed_is_stable_and_in_range():
    assert step_seed(1234, 0) == step_seed(1234, 0)
    assert step_seed(1234, 0) == 0x4F0BF1AFB6C91C76
    values = {step_seed(s, i) for s in (-1, 0, 1, 2**63 + 5) for i in range(50)}
    assert len(values) == 200
    assert all(0 <= v < 2**63 for v in values)


def test_metadata_from_params():
    params = [
        SamplingParams(temperature=0.0, seed=1, logprobs=2),
        SamplingParams(temperature=0.8, top_k=-1, top_p=0.9, seed=2, logprobs=5),
        SamplingParams(top_k=10, min_p=0.1),
    ]
    md = SamplingMetadata.from_params(params, [11, 22, None], "cpu")
    assert md.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert md.top_k.tolist() == [0, 0, 10] and md.top_k.dtype == torch.int64
    assert md.top_p.dtype == md.min_p.dtype == md.temperature.dtype == torch.float32
    assert set(md.generators) == {1}  # greedy rows draw nothing
    assert md.max_num_logprobs == 5
    assert not md.all_greedy and not md.all_random
    assert (md.no_top_k, md.no_top_p, md.no_min_p) == (False, False, False)
    plain = SamplingMetadata.from_params([SamplingParams()], [None], "cpu")
    assert plain.all_random and plain.no_top_k and plain.no_top_p and plain.no_min_p
    assert plain.max_num_logprobs is None
    with pytest.raises(ValueError, match="seeds_for_step"):
        SamplingMetadata.from_params(params, [None], "cpu")


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_are_raw_log_softmax_with_sampled_first(k):
    n, vocab = 12, 400
    logits = torch.randn(n, vocab) * 2
    # high temperature and a wide top-k make the sampled token often fall outside the top-k logprobs
    params = [
        SamplingParams(temperature=t, logprobs=k, top_k=tk)
        for t, tk in zip([0.0, 0.5, 1.0, 5.0] * 3, [0, 3, 0, 300] * 3, strict=True)
    ]
    out = sample(logits, params)
    ref = torch.log_softmax(logits.double(), dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == out.logprobs.shape == (n, 1 + k)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(
        out.logprobs.double(), ref.gather(-1, out.logprob_token_ids), rtol=0, atol=1e-5
    )
    ref_top = ref.topk(k, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], ref_top.indices)
    ref_ranks = (ref > ref.gather(-1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_token_ranks, ref_ranks)
    assert (out.sampled_token_ranks[0::4] == 1).all()  # greedy rows sample the best token
    if k <= 1:
        assert (out.sampled_token_ranks > k).any()


def test_logprobs_are_computed_before_temperature_and_filters():
    logits = torch.randn(4, 50)
    out = sample(logits, [SamplingParams(temperature=0.3, top_k=2, logprobs=3)] * 4)
    torch.testing.assert_close(out.logprobs[:, 1:], torch.log_softmax(logits, -1).topk(3).values)


def test_no_logprobs_when_nobody_asks():
    out = sample(torch.randn(3, 20), [SamplingParams()] * 3)
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None


def test_does_not_modify_the_logits():
    logits = torch.randn(4, 64)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2, logprobs=2)] * 4)
    assert torch.equal(logits, before)
