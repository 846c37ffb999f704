"""The n-gram drafter against a brute-force search, and the speculative_config parsing and refusals."""

from __future__ import annotations

import random

import pytest

from deltaserve.config.speculative import SpeculativeConfig
from deltaserve.spec.ngram_proposer import NgramProposer


def brute_force(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposals_equal_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k, low = rng.randrange(1, 6), rng.randrange(1, 4)
        high = low + rng.randrange(0, 4)
        assert NgramProposer(k, low, high).propose(tokens) == brute_force(tokens, k, low, high), (tokens, k, low, high)


def test_longest_match_then_latest_and_the_draft_cap():
    proposer = NgramProposer(3, 1, 3)
    #          a  b  c  X  Y  b  c  Z  .  a  b  c   -> "a b c" matched at 0 (longest), drafts X Y b
    tokens = [1, 2, 3, 8, 9, 2, 3, 7, 0, 1, 2, 3]
    assert proposer.propose(tokens) == [8, 9, 2]
    assert proposer.propose(tokens, max_drafts=1) == [8]
    assert proposer.propose(tokens, max_drafts=0) == []
    assert NgramProposer(3, 1, 2).propose(tokens) == [7, 0, 1]  # "b c": its latest earlier occurrence is at 5
    assert proposer.propose([4, 5, 6]) == []  # nothing repeats
    assert proposer.propose([5]) == []


def test_config_defaults_and_parsing():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's default window
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 5, "model": "/d"})
    assert config.model == "/d" and SpeculativeConfig.parse(config) is config


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"method": "medusa", "num_speculative_tokens": 1}, "method='medusa' is not one of"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 exceeds prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/d"}, "takes no model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/d", "prompt_lookup_max": 3},
     "belong to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key(s) typo"),
])
def test_config_refusals_name_the_cause(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


def test_propose_for_a_request_keeps_its_tokens_incrementally():
    from deltaserve.core.request import Request

    proposer = NgramProposer(3, 1, 3)
    request = Request("r", [5, 6, 7, 8, 5, 6], max_tokens=10)
    assert proposer.propose_for(request, 3) == proposer.propose(request.all_token_ids) == [7, 8, 5]
    for token in (7, 8, 9, 5, 6, 7):  # outputs arrive; the array grows by what is new
        request.output_token_ids.append(token)
        assert proposer.propose_for(request, 3) == proposer.propose(request.all_token_ids)
    assert request.draft_state[1] == request.num_tokens
