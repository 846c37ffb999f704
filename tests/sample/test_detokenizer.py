"""IncrementalDetokenizer on a byte-level tokenizer (256 byte tokens, no merges) built inline.

With one byte per token every non-ASCII character spans several tokens, the hard case for streaming.
"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from deltaserve.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from deltaserve.sampling_params import SamplingParams

TEXT = "héllo wörld, 你好 🎉 — naïve café ✓ end"


@pytest.fixture(scope="module")
def tokenizer():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    assert len(fast.encode("你", add_special_tokens=False)) == 3  # one token per byte
    return fast


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def feed(detok, ids, **kwargs):
    """Feed ids one at a time; return (stop string or None, index of the stopping token)."""
    for i, t in enumerate(ids):
        stop = detok.update([t], **kwargs)
        assert not detok.output_text.endswith("\ufffd")
        if stop is not None:
            return stop, i
    return None, None


@pytest.mark.parametrize("prompt", ["", "Prompt: ", "ends mid-char é"])
def test_streamed_text_equals_full_decode(tokenizer, prompt):
    ids = encode(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams())
    deltas = []
    for t in ids:
        assert detok.update([t]) is None
        assert not detok.output_text.endswith("\ufffd")
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    assert detok.output_text == tokenizer.decode(ids) == TEXT
    assert "".join(deltas) == TEXT
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.num_output_tokens == len(ids)


def test_several_tokens_per_update(tokenizer):
    ids = encode(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for i in range(0, len(ids), 4):
        detok.update(ids[i : i + 4])
    assert detok.output_text == TEXT


def test_incomplete_character_is_held_back(tokenizer):
    ids = encode(tokenizer, "a你")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:2])
    assert detok.output_text == "a"
    detok.update(ids[2:3])
    assert detok.output_text == "a"
    detok.update(ids[3:])
    assert detok.output_text == "a你"


@pytest.mark.parametrize("stop", ["STOP", "好 🎉", "🎉"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_straddling_tokens(tokenizer, stop, include):
    text = "abc 你好 🎉 STOP after"
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=["never", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    found, at = feed(detok, ids)
    assert found == stop
    end = text.index(stop) + len(stop)
    assert at == len(encode(tokenizer, text[:end])) - 1  # found on the token that completes it
    assert detok.output_text == (text[:end] if include else text[: text.index(stop)])
    assert detok.update(encode(tokenizer, "more")) is None  # nothing is added after a stop
    assert detok.output_text == (text[:end] if include else text[: text.index(stop)])


def test_earliest_stop_string_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["yz", "x"]))
    assert detok.update(encode(tokenizer, "abxyz")) == "x"  # not the first listed
    assert detok.output_text == "ab"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = encode(tokenizer, "ab#cd#ef")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="#", min_tokens=4))
    found, at = feed(detok, ids)
    assert (found, at) == ("#", 5)
    assert detok.output_text == "ab#cd"


def test_streaming_holds_back_a_possible_stop_string(tokenizer):
    text = "hello STOP there"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="STOP"))
    streamed = ""
    for t in encode(tokenizer, text):
        stop = detok.update([t])
        streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
        assert not streamed.endswith(("S", "ST", "STO"))
        if stop:
            break
    assert streamed == detok.output_text == "hello "
    assert detok.get_next_output_text(finished=True, delta=False) == "hello "


def held_back(text, stops):
    """The reference: the longest tail of `text` that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(len(s)) if k and text.endswith(s[:k])), default=0)


def stream_chars(detok, tokenizer, text):
    """Feed `text` one character at a time; return (stop, the text streamed after each character)."""
    streamed, after_each = "", []
    for ch in text:
        stop = detok.update(encode(tokenizer, ch))
        streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
        after_each.append(streamed)
        if stop is not None:
            return stop, after_each
    return None, after_each


def test_long_stop_string_holds_back_only_a_possible_start(tokenizer):
    stop = "<" + "z" * 1500 + ">"
    text = "no stop here, <zzz but not it, you"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stop))
    found, after_each = stream_chars(detok, tokenizer, text)
    assert found is None
    assert after_each[len("no stop here") - 1] == "no stop here"  # streamed long before the end
    assert after_each[len("no stop here, <zzz") - 1] == "no stop here, "  # "<zzz" may still be the stop
    assert after_each[-1] == text


@pytest.mark.parametrize(
    "stops, text, streamed",
    [
        (["STOP", "abc"], "xx ST", "xx "),
        (["STOP", "abc"], "xx STa", "xx ST"),
        (["STOP", "abc"], "xx STab", "xx ST"),
        (["STOP", "abc"], "xx STabX", "xx STabX"),
        (["aab"], "aaaa", "aa"),  # the tail "aa" overlaps the "a" before it
        (["abac"], "xaba", "x"),
        (["abac"], "xabab", "xab"),  # "abab" is no prefix, its tail "ab" is
        (["你好!"], "a你好", "a"),
    ],
)
def test_streaming_holds_back_the_longest_possible_stop_start(tokenizer, stops, text, streamed):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
    found, after_each = stream_chars(detok, tokenizer, text)
    assert found is None and after_each[-1] == streamed
    assert detok.get_next_output_text(finished=False, delta=False) == streamed


def test_nothing_is_held_back_when_the_stop_string_is_kept(tokenizer):
    params = SamplingParams(stop="STOP", include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    found, after_each = stream_chars(detok, tokenizer, "a STOP b")
    assert found == "STOP" and after_each[len("a ST") - 1] == "a ST"
    assert after_each[-1] == detok.output_text == "a STOP"


@pytest.mark.parametrize("seed", range(300))
def test_streamed_text_equals_the_final_text(tokenizer, seed):
    """Random texts, stop strings, chunking, min_tokens: streamed deltas add up to the final text,
    hold back exactly the longest possible start of a stop string, and never take text back."""
    rng = random.Random(seed)
    alphabet = "ab a你é"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
    params = SamplingParams(
        stop=stops, min_tokens=rng.randint(0, 5), include_stop_str_in_output=rng.random() < 0.3
    )
    ids = encode(tokenizer, text)
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4)
        chunks.append(ids[i : i + size])
        i += size
    detok = IncrementalDetokenizer(tokenizer, [], params)
    plain = IncrementalDetokenizer(tokenizer, [], params)  # the same updates, never streamed
    deltas, cumulative = [], ""
    for n, chunk in enumerate(chunks):
        stop = detok.update(chunk)
        assert plain.update(chunk) == stop
        finished = stop is not None or n == len(chunks) - 1
        deltas.append(detok.get_next_output_text(finished, delta=True))
        now = detok.get_next_output_text(finished, delta=False)
        assert now.startswith(cumulative) and now == "".join(deltas)  # nothing is taken back
        cumulative = now
        if not finished and not params.include_stop_str_in_output:
            assert len(detok.output_text) - len(now) == held_back(detok.output_text, stops)
        if finished:
            break
    final = plain.get_next_output_text(finished=True, delta=False)
    assert final == plain.output_text == detok.output_text
    assert "".join(deltas) == final


def test_stop_terminated_token_text_is_left_out(tokenizer):
    ids = encode(tokenizer, "abc!")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:3])
    detok.update(ids[3:], stop_terminated=True)
    assert detok.output_text == "abc" and detok.num_output_tokens == 4
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(include_stop_str_in_output=True))
    kept.update(ids, stop_terminated=True)
    assert kept.output_text == "abc!"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = encode(tokenizer, "hi") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    feed(detok, ids)
    assert detok.output_text == ("hi" if skip else "hi<eos>")


def test_without_tokenizer_text_stays_empty_and_stops_are_ignored():
    detok = IncrementalDetokenizer(None, [1, 2, 3], SamplingParams(stop="a"))
    assert detok.update([97, 98]) is None
    assert detok.output_text == "" and detok.num_output_tokens == 2
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_decode_logprobs(tokenizer):
    ids = encode(tokenizer, "a你")
    texts = decode_logprobs(tokenizer, ids + [tokenizer.eos_token_id])
    assert texts[0] == "a" and texts[-1] == "<eos>"
    assert all(t == "\ufffd" for t in texts[1:4])  # a partial character decodes alone to U+FFFD
