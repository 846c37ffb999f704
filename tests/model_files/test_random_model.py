"""`--model random:<preset>`: built in memory, the same weights and tokens as the checkpoint make-model writes."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model_files.embedded import embedded_model_dir
from deltaserve.model_files.random_model import random_preset_name


def test_random_model_generates_what_the_embedded_checkpoint_does():
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    a = LLM(model="random:tiny", max_model_len=512, cache_memory="32MiB").generate("Hi there", params, use_tqdm=False)
    embedded = LLM(model=embedded_model_dir(), max_model_len=512, cache_memory="32MiB")
    b = embedded.generate("Hi there", params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].text == b[0].outputs[0].text


def test_random_preset_names():
    assert random_preset_name("random:small") == "small"
    assert random_preset_name("/some/dir") is None
    with pytest.raises(ValueError, match="preset='nope'"):
        random_preset_name("random:nope")
