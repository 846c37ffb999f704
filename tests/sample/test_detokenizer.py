"""IncrementalDetokenizer on a byte-level tokenizer (256 byte tokens, no merges) built inline.

With one byte per token every non-ASCII character spans several tokens, the hard case for streaming.
"""

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
