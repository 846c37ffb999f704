"""Verification of draft tokens: greedy rows against a Python loop, random rows' emitted tokens against the
target distribution (chi-square), seeded rows against batch composition, and top-k/top-p honoured.

Fresh random logits in every test; the global RNG is seeded so failures reproduce.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deltaserve.sample import Sampler, SamplingMetadata, step_seed
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec.rejection_sampler import RejectionMetadata, RejectionSampler

sampler = RejectionSampler()

try:
    from scipy.stats import chi2 as _chi2
except ImportError:
    _chi2 = None
# chi-square critical values at p = 0.001 by degrees of freedom (standard tables; scipy.stats.chi2.isf(1e-3, df))
_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def verify(logits, drafts, num_drafts, params, draft_probs=None, num_output_tokens=None):
    done = num_output_tokens if num_output_tokens is not None else [0] * len(params)
    metadata = RejectionMetadata.from_params(params, num_drafts, done, logits.device)
    return sampler(logits, drafts, draft_probs, metadata)


def split_rows(num_drafts: list[int]) -> list[range]:
    """The target-logits rows of each request: its drafts' rows, then its bonus row."""
    rows, start = [], 0
    for n in num_drafts:
        rows.append(range(start, start + n + 1))
        start += n + 1
    return rows


def greedy_loop(logits: torch.Tensor, drafts: list[int], num_drafts: list[int]) -> list[list[int]]:
    """Plain greedy decoding checked token by token against the drafts."""
    out, offset = [], 0
    for rows, n in zip(split_rows(num_drafts), num_drafts, strict=True):
        tokens = []
        for j, row in enumerate(rows):
            best = int(logits[row].argmax())
            tokens.append(best)
            if j == n or drafts[offset + j] != best:
                break
        out.append(tokens)
        offset += n
    return out


def random_greedy_case(num_requests: int, vocab: int, max_draft: int, match: float):
    num_drafts = torch.randint(0, max_draft + 1, (num_requests,)).tolist()
    logits = torch.randn(sum(num_drafts) + num_requests, vocab) * 2
    drafts = []
    for rows, n in zip(split_rows(num_drafts), num_drafts, strict=True):
        for row in list(rows)[:n]:
            hit = torch.rand(()) < match
            drafts.append(int(logits[row].argmax()) if hit else int(torch.randint(vocab, ())))
    return logits, torch.tensor(drafts, dtype=torch.int64), num_drafts


def test_greedy_equals_a_python_loop_with_padded_layout():
    logits, drafts, num_drafts = random_greedy_case(40, 64, 5, match=0.8)
    out = verify(logits, drafts, num_drafts, [SamplingParams(temperature=0.0)] * 40)
    expected = greedy_loop(logits, drafts.tolist(), num_drafts)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (40, max(num_drafts) + 1)
    assert out.tolist() == expected
    assert out.num_tokens.tolist() == [len(t) for t in expected]
    for row, count in zip(out.token_ids.tolist(), out.num_tokens.tolist(), strict=True):
        assert all(t == -1 for t in row[count:])
    assert any(len(t) == n + 1 for t, n in zip(expected, num_drafts, strict=True) if n > 0)  # some all-accepted


def test_greedy_rows_unchanged_among_random_rows():
    logits, drafts, num_drafts = random_greedy_case(30, 64, 4, match=0.7)
    params = [SamplingParams(temperature=0.0) if r % 3 else SamplingParams(temperature=0.8, seed=r) for r in range(30)]
    out = verify(logits, drafts, num_drafts, params).tolist()
    expected = greedy_loop(logits, drafts.tolist(), num_drafts)
    assert [t for r, t in enumerate(out) if r % 3] == [t for r, t in enumerate(expected) if r % 3]


def test_greedy_all_accepted_gives_bonus_argmax_and_no_drafts_give_argmax():
    num_drafts = [3, 0, 2, 0]
    logits = torch.randn(sum(num_drafts) + 4, 100)
    rows = split_rows(num_drafts)
    draft_rows = [row for rows_r, n in zip(rows, num_drafts, strict=True) for row in list(rows_r)[:n]]
    drafts = logits[draft_rows].argmax(-1)
    out = verify(logits, drafts, num_drafts, [SamplingParams(temperature=0.0)] * 4).tolist()
    argmax = logits.argmax(-1).tolist()
    assert out == [[argmax[row] for row in r] for r in rows]
    assert out[1] == [argmax[rows[1][0]]] and out[3] == [argmax[rows[3][0]]]


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Naive float64 reference of the Sampler's processing of one row [V]: temperature, top-k, top-p, min-p."""
    x = logits.double() / p.temperature
    order = torch.argsort(x, descending=True).tolist()
    keep = order[: p.top_k] if p.top_k > 0 else order
    if p.top_p < 1.0:
        probs, mass, cut = torch.softmax(x[keep], dim=0).tolist(), 0.0, []
        for tok, pr in zip(keep, probs, strict=True):
            cut.append(tok)
            mass += pr
            if mass >= p.top_p:
                break
        keep = cut
    kept = torch.full_like(x, float("-inf"))
    kept[keep] = x[keep]
    probs = torch.softmax(kept, dim=0)
    probs[probs < p.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int, float]:
    """-> (statistic, degrees of freedom, critical value at p = 0.001). Zero-probability tokens must not occur."""
    counts = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    expected = expected_probs[support] * counts.sum()
    assert expected.min() >= 5, "too few trials for a chi-square test"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    critical = float(_chi2.isf(1e-3, df)) if _chi2 is not None else _CRITICAL_0_001[df]
    return statistic, df, critical


@pytest.mark.parametrize("drafter", ["ngram", "probs"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.97, min_p=0.03)],
    ids=["plain", "processed"],
)
def test_emitted_tokens_follow_the_target_distribution(drafter, params):
    """20,000 seeded requests, 2 drafts each, vocabulary 6, the same three target positions in every request.

    Token 1 of every request ~ p1; token 2 where draft 1 was accepted ~ p2; token 3 (the bonus) where both
    were ~ p3. Drafts are drawn from fixed draft distributions q1, q2, which the n-gram case does not pass."""
    trials, vocab, k = 20_000, 6, 2
    position_logits = torch.randn(k + 1, vocab)
    expected = [reference_probs(position_logits[j], params) for j in range(k + 1)]
    # skewed, not uniform: uniform n-gram drafts would hide a recovery drawn from p instead of p without d
    q = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    q[0, 1] = 0.0  # a token the drafter never proposes
    q = q / q.sum(-1, keepdim=True)
    generator = torch.Generator().manual_seed(1)
    draws = [torch.multinomial(q[j], trials, replacement=True, generator=generator) for j in range(k)]
    drafts = torch.stack(draws, dim=1)
    draft_probs = None if drafter == "ngram" else q.repeat(trials, 1)
    logits = position_logits.repeat(trials, 1)
    all_params = [replace(params, seed=trial) for trial in range(trials)]
    out = verify(logits, drafts.reshape(-1), [k] * trials, all_params, draft_probs)
    tokens, counts = out.token_ids, out.num_tokens
    stats = []
    for j in range(k + 1):
        reached = counts > j
        statistic, df, critical = chi_square(tokens[reached, j], expected[j])
        stats.append((j + 1, int(reached.sum()), round(statistic, 2), df, round(critical, 3)))
        assert statistic < critical, stats
    print(f"{drafter} {params.temperature=} (position, trials reaching it, chi2, df, critical): {stats}")


def test_seeded_tokens_do_not_depend_on_the_batch():
    vocab = 80
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    my_logits, my_drafts = torch.randn(4, vocab), torch.randint(vocab, (3,))
    my_probs = torch.softmax(torch.randn(3, vocab), dim=-1)
    alone = verify(my_logits, my_drafts, [3], [mine], my_probs, num_output_tokens=[7]).tolist()[0]

    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=5)]
    before, after = [2, 0], [4]
    num_drafts = before + [3] + after
    rows = split_rows(num_drafts)
    logits = torch.randn(sum(num_drafts) + len(num_drafts), vocab)
    logits[rows[2].start : rows[2].stop] = my_logits
    drafts = torch.randint(vocab, (sum(num_drafts),))
    drafts[2:5] = my_drafts
    probs = torch.softmax(torch.randn(sum(num_drafts), vocab), dim=-1)
    probs[2:5] = my_probs
    params = [others[0], others[1], mine, others[2]]
    for _ in range(3):  # the global RNG moves on between calls; the seeded row must not
        batched = verify(logits, drafts, num_drafts, params, probs, num_output_tokens=[0, 3, 7, 11]).tolist()
        assert batched[2] == alone
    later = [verify(my_logits, my_drafts, [3], [mine], my_probs, num_output_tokens=[t]) for t in range(8, 12)]
    assert any(x.tolist()[0] != alone for x in later)  # the step index feeds the seed


def test_no_drafts_draws_the_plain_samplers_token():
    params = [SamplingParams(temperature=t, top_k=k, seed=s) for t, k, s in [(1.0, 0, 3), (0.6, 20, 9), (1.3, 0, 11)]]
    logits = torch.randn(3, 200)
    done = [0, 5, 42]
    out = verify(logits, torch.empty(0, dtype=torch.int64), [0, 0, 0], params, num_output_tokens=done)
    seeds = [step_seed(p.seed, t) for p, t in zip(params, done, strict=True)]
    plain = Sampler()(logits, SamplingMetadata.from_params(params, seeds, logits.device)).sampled_token_ids
    assert out.token_ids.shape == (3, 1) and out.num_tokens.tolist() == [1, 1, 1]
    assert out.token_ids[:, 0].tolist() == plain.tolist()


@pytest.mark.parametrize("drafter", ["ngram", "probs"])
def test_top_k_and_top_p_are_honoured(drafter):
    trials, vocab, k = 2000, 50, 3
    position_logits = torch.randn(k + 1, vocab)
    cases = [SamplingParams(temperature=1.5, top_k=4), SamplingParams(temperature=1.5, top_p=0.3)]
    for p in cases:
        allowed = [set(reference_probs(position_logits[j], p).nonzero().flatten().tolist()) for j in range(k + 1)]
        drafts = torch.randint(vocab, (trials, k))
        # the first two drafts are each position's likeliest token, so later positions are reached; the third
        # is mostly outside the kept set and must never be accepted
        drafts[:, :2] = position_logits[:2].argmax(-1)
        probs = None if drafter == "ngram" else torch.softmax(torch.randn(trials * k, vocab), dim=-1)
        params = [replace(p, seed=t if t % 2 else None) for t in range(trials)]
        out = verify(position_logits.repeat(trials, 1), drafts.reshape(-1), [k] * trials, params, probs).tolist()
        assert max(len(t) for t in out) == k + 1
        for tokens in out:
            assert all(token in allowed[j] for j, token in enumerate(tokens)), (p, tokens)


def test_shape_errors_name_the_field():
    metadata = RejectionMetadata.from_params([SamplingParams()] * 2, [2, 1], [0, 0], "cpu")
    with pytest.raises(ValueError, match="target_logits"):
        sampler(torch.randn(4, 10), torch.zeros(3, dtype=torch.int64), None, metadata)
    with pytest.raises(ValueError, match="draft_token_ids"):
        sampler(torch.randn(5, 10), torch.zeros(2, dtype=torch.int64), None, metadata)
    with pytest.raises(ValueError, match="draft_probs"):
        sampler(torch.randn(5, 10), torch.zeros(3, dtype=torch.int64), torch.rand(3, 9), metadata)
    with pytest.raises(ValueError, match="num_draft_per_request"):
        RejectionMetadata.from_params([SamplingParams()], [-1], [0], "cpu")
