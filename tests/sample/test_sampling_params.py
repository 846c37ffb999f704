"""SamplingParams: vLLM's defaults, normalisation, and a ValueError naming the field for every bad value."""

import pickle

import pytest

from deltaserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.ignore_eos) == (16, 0, None, False)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output and not p.greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=2), "n"),
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-1.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=1.0), "seed"),
        (dict(seed="7"), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"^{field}\b") as info:
        SamplingParams(**kwargs)
    if name == field and not isinstance(value, list):  # list fields name the bad element instead
        assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(min_p=1.0),
        dict(max_tokens=None, min_tokens=100),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(seed=-5),
        dict(temperature=0),
        dict(temperature=2),
        dict(max_tokens=1, min_tokens=1),
    ],
)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_picklable():
    p = SamplingParams(temperature=0.7, top_k=5, stop="x", seed=3, logprobs=2)
    assert pickle.loads(pickle.dumps(p)) == p
