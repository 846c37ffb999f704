"""The byte tokenizer round-trips any text, saves and loads offline; load_tokenizer's cases."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from deltaserve.model_files.tokenizer import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    PAD,
    build_byte_tokenizer,
    load_tokenizer,
    special_token_ids,
)

TEXTS = [
    "Hello, world",
    "héllo 世界 🎉 👩‍👩‍👧 ∑∫ \u200b zero-width",
    "\x00\x01 control\r\n\ttabs   and trailing spaces  ",
    "",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok"))
    build_byte_tokenizer(512).save_pretrained(out)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_exact(saved, text):
    tok = AutoTokenizer.from_pretrained(saved)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_special_token_text_encodes_to_its_id_and_decodes_back(saved):
    tok = AutoTokenizer.from_pretrained(saved)
    text = " lead <|bos|> mid <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert 256 in ids and 260 in ids
    assert tok.decode(ids) == text


def test_loads_with_autotokenizer(saved):
    tok = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    assert len(tok) == 512
    assert special_token_ids(tok) == (256, 257, 258)
    assert tok.convert_tokens_to_ids([BOS, EOS, PAD, IM_START, IM_END]) == [256, 257, 258, 259, 260]
    assert tok.convert_ids_to_tokens(511) == "<|reserved_511|>"
    assert tok.decode([256, 72, 105, 257], skip_special_tokens=True) == "Hi"


def test_chat_template_renders(saved):
    tok = AutoTokenizer.from_pretrained(saved)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☃<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 259 and ids[-2:] == [260, ord("\n")]


def test_special_ids_placed_where_asked():
    tok = build_byte_tokenizer(1000, {BOS: 900, EOS: 902, PAD: 999})
    assert special_token_ids(tok) == (900, 902, 999)
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [256, 257]
    assert len(tok) == 1000


@pytest.mark.parametrize(
    "vocab, ids, match",
    [(100, None, "vocab_size=100"), (512, {BOS: 10}, "ids below 256"), (512, {BOS: 300, EOS: 300}, "collide"),
     (512, {"<|x|>": 300}, "unknown special token")],
)
def test_bad_arguments_are_named(vocab, ids, match):
    with pytest.raises(ValueError, match=match):
        build_byte_tokenizer(vocab, ids)


def test_load_tokenizer(saved, tmp_path):
    assert load_tokenizer(saved).encode("ab", add_special_tokens=False) == [97, 98]
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer files
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "nowhere"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=f"tokenizer files in '{os.fspath(broken)}'"):
        load_tokenizer(str(broken))
