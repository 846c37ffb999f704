"""A prefill chunk after more cached context than EXPANSION_GROUP_TOKENS attends to it in pieces merged by
log-sum-exp (MLA's `_attend_long_context`). With pieces of 16 tokens on the tiny model, the scenarios of
test_multiproc_engine (chunked prefill, a second turn from the first's cache, preemption, an abort) give
the greedy tokens and logprobs of the one-pass path, and the pieces path really ran."""

from __future__ import annotations

import pytest
from distributed.test_multiproc_engine import COMMON, _assert_same, run_scenarios
from hf_reference import checkpoint_dir, tiny_hub_config

from deltaserve import LLM
from deltaserve.model.layers import mla


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = checkpoint_dir(tmp_path_factory, "mla-long-context", tiny_hub_config(), seed=17)
    return path


def test_context_in_pieces_matches_one_pass(model_dir, monkeypatch):
    one_pass = run_scenarios(LLM(model=model_dir, **COMMON))

    calls = []
    attend = mla.MultiheadLatentAttention._attend_long_context

    def counted(self, q, seq, entries, dcp):
        calls.append(seq.num_context_tokens)
        return attend(self, q, seq, entries, dcp)

    monkeypatch.setattr(mla, "EXPANSION_GROUP_TOKENS", 16)
    monkeypatch.setattr(mla.MultiheadLatentAttention, "_attend_long_context", counted)
    pieces = run_scenarios(LLM(model=model_dir, **COMMON))
    assert calls and max(calls) > 2 * 16, "chunks after more than two pieces of context must take the pieces path"
    for key in ("turn1", "turn2", "abort"):
        if key == "abort":
            assert pieces[key] == one_pass[key]
        else:
            _assert_same(pieces[key], one_pass[key], key)
    for i, (got, want) in enumerate(zip(pieces["batch"], one_pass["batch"], strict=True)):
        _assert_same(got, want, f"batch {i}")
