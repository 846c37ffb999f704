"""A byte-level BPE tokenizer trained on the corpus, saved in the Hugging Face layout.

Special tokens take the first ids, in deltaserve's order: <|bos|>=0, <|eos|>=1, <|pad|>=2,
<|im_start|>=3, <|im_end|>=4. Encoding adds no special tokens (documents are joined with <|eos|>
by the caller). The saved directory holds tokenizer.json, tokenizer_config.json (with the chat
template as a jinja string), special_tokens_map.json and chat_template.jinja, and loads with
`transformers.AutoTokenizer.from_pretrained` and `deltaserve.model_files.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from deltaserve.model_files.tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    as_fast_tokenizer,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Any:
    """A `tokenizers.Tokenizer`: byte-level BPE with `vocab_size` ids in all (specials included)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"tokenizer: vocab_size={vocab_size} is below the {len(alphabet)} byte symbols plus "
            f"{len(SPECIAL_TOKENS)} special tokens; choose at least {len(alphabet) + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"tokenizer: {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def save_hf_tokenizer(tok: Any, out_dir: str, model_max_length: int) -> Any:
    """Save `tok` as a `PreTrainedTokenizerFast` directory; returns the fast tokenizer."""
    fast = as_fast_tokenizer(tok, model_max_length)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Older readers look for the template in tokenizer_config.json and for special_tokens_map.json;
    # transformers 5 writes neither, so add both.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.setdefault("add_bos_token", False)
    cfg.setdefault("add_eos_token", False)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    special_map = {
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END],
    }
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special_map, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return fast


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer files that exist in `src_dir` into `dst_dir`; returns the names copied."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
