"""A byte-level tokenizer for random models, and loading a checkpoint's own tokenizer.

The byte tokenizer maps each of the 256 byte values to one id (id == byte value), through the
GPT-2 byte-to-unicode alphabet with no merges, so any UTF-8 text round-trips exactly. Special
tokens follow, then `<|reserved_{id}|>` fillers up to the vocabulary size. The fillers are plain
vocabulary entries rather than added tokens (no text ever encodes to them, they decode to their
name), which keeps a 163,840-entry tokenizer quick to load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
NUM_BYTES = 256

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = printable[:]
    n = 0
    for b in range(NUM_BYTES):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTES + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _place_specials(vocab_size: int, special_token_ids: Mapping[str, int] | None) -> dict[str, int]:
    placed = dict(special_token_ids or {})
    for token, i in placed.items():
        if token not in SPECIAL_TOKENS:
            known = ", ".join(SPECIAL_TOKENS)
            raise ValueError(f"tokenizer: unknown special token {token!r}; known: {known}")
        if not NUM_BYTES <= i < vocab_size:
            raise ValueError(
                f"tokenizer: {token} id {i} must lie in [{NUM_BYTES}, vocab_size={vocab_size}); ids below "
                f"{NUM_BYTES} are the bytes"
            )
    if len(set(placed.values())) != len(placed):
        raise ValueError(f"tokenizer: special token ids collide: {placed}")
    free = (i for i in range(NUM_BYTES, vocab_size) if i not in placed.values())
    for token in SPECIAL_TOKENS:
        if token not in placed:
            placed[token] = next(free)
    return placed


def build_byte_tokenizer(
    vocab_size: int = 512,
    special_token_ids: Mapping[str, int] | None = None,
    model_max_length: int | None = None,
) -> Any:
    """A `transformers.PreTrainedTokenizerFast` over bytes with `vocab_size` ids.

    special_token_ids places some of SPECIAL_TOKENS at given ids (e.g. a config's bos/eos/pad);
    the others take the lowest free ids from 256. Encoding adds no special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < NUM_BYTES + len(SPECIAL_TOKENS):
        raise ValueError(
            f"tokenizer: vocab_size={vocab_size} is too small for a byte tokenizer; it needs at least "
            f"{NUM_BYTES + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    specials = _place_specials(vocab_size, special_token_ids)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab.update(specials)
    taken = set(vocab.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(NUM_BYTES, vocab_size) if i not in taken})

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return as_fast_tokenizer(tok, model_max_length)


def as_fast_tokenizer(tok: Any, model_max_length: int | None = None) -> Any:
    """Wrap a `tokenizers.Tokenizer` holding SPECIAL_TOKENS as a `PreTrainedTokenizerFast` with
    deltaserve's special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


class SpecialTokenIds(NamedTuple):
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def special_token_ids(tokenizer: Any) -> SpecialTokenIds:
    """The tokenizer's bos / eos / pad ids (None where it has no such token)."""
    return SpecialTokenIds(tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)


def has_tokenizer_files(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: str, trust_remote_code: bool = False) -> Any | None:
    """`AutoTokenizer` of a local directory, or None when it holds no tokenizer files.

    Files that exist but do not load are a ValueError naming the directory.
    """
    if not os.path.isdir(model_dir):
        raise ValueError(
            f"tokenizer: {model_dir!r} is not a directory; pass a local checkpoint or tokenizer directory"
        )
    if not has_tokenizer_files(model_dir):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as e:  # any failure here means the files are unusable
        hint = "" if trust_remote_code else " (if it ships tokenizer code, set trust_remote_code=True)"
        raise ValueError(f"tokenizer: the tokenizer files in {model_dir!r} failed to load{hint}: {e}") from e
