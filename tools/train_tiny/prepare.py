"""`prepare`: list the corpus, train the tokenizer on its train split, write the token streams.

The output directory (carry it to the GPU machine) holds
- tokenizer/: the Hugging Face tokenizer files (bpe.py);
- train.bin, val.bin: uint16 token ids, each document followed by <|eos|>;
- corpus_files.txt/.json: the file list with per-file sha256 and the list's own sha256;
- meta.json: vocabulary, token and byte counts per split (bytes: UTF-8 bytes of the documents,
  for bits per byte), the tokenizer's sha256 and the corpus list's sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import numpy as np

from tools.train_tiny import bpe, corpus

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MODEL_MAX_LENGTH = 8192
TOKEN_DTYPE = np.uint16


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def encode_stream(tok, texts: list[str], eos_id: int) -> np.ndarray:
    """Every text's ids followed by eos_id, concatenated: [sum(len_i + 1)] uint16."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int64))
        parts.append(np.asarray([eos_id], dtype=np.int64))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if ids.size and ids.max() > np.iinfo(TOKEN_DTYPE).max:
        raise ValueError(f"prepare: token id {ids.max()} does not fit in {TOKEN_DTYPE.__name__}")
    return ids.astype(TOKEN_DTYPE)


def prepare(
    out_dir: str,
    root: str | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    held_out_per_10k: int = corpus.DEFAULT_HELD_OUT_PER_10K,
    manifest_path: str | None = None,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    max_files: int | None = None,
) -> dict:
    """Write the data directory `out_dir`; returns meta.json's contents.

    root: the stdlib directory (default: this interpreter's). manifest_path: where corpus_files.txt
    goes besides `out_dir` (e.g. tools/train_tiny/corpus_files.txt). max_files: keep only the first
    n files of each split (micro runs and tests).
    """
    t0 = time.perf_counter()
    root = root or corpus.stdlib_dir()
    files, excluded = corpus.select_files(root, held_out_per_10k)
    if max_files is not None:
        by_split = [[f for f in files if f.split == s][:max_files] for s in (corpus.TRAIN, corpus.VAL)]
        files = sorted(by_split[0] + by_split[1], key=lambda f: f.relpath)
    train_files = [f for f in files if f.split == corpus.TRAIN]
    val_files = [f for f in files if f.split == corpus.VAL]
    if not train_files or not val_files:
        raise ValueError(
            f"prepare: {root!r} gave {len(train_files)} train and {len(val_files)} val files; both must be non-empty"
        )
    os.makedirs(out_dir, exist_ok=True)
    list_path = os.path.join(out_dir, "corpus_files.txt")
    summary = corpus.write_manifest(files, excluded, root, list_path, held_out_per_10k)
    if manifest_path is not None and os.path.abspath(manifest_path) != os.path.abspath(list_path):
        os.makedirs(os.path.dirname(os.path.abspath(manifest_path)), exist_ok=True)
        shutil.copyfile(list_path, manifest_path)
        shutil.copyfile(os.path.splitext(list_path)[0] + ".json", os.path.splitext(manifest_path)[0] + ".json")

    train_texts = corpus.read_texts(root, train_files)
    val_texts = corpus.read_texts(root, val_files)
    t1 = time.perf_counter()
    tok = bpe.train_bpe(train_texts, vocab_size)
    tok_dir = os.path.join(out_dir, "tokenizer")
    bpe.save_hf_tokenizer(tok, tok_dir, model_max_length)
    t2 = time.perf_counter()
    eos_id = tok.token_to_id(bpe.EOS)
    streams = {corpus.TRAIN: encode_stream(tok, train_texts, eos_id), corpus.VAL: encode_stream(tok, val_texts, eos_id)}
    for split, ids in streams.items():
        ids.tofile(os.path.join(out_dir, f"{split}.bin"))
    t3 = time.perf_counter()

    meta = {
        "vocab_size": tok.get_vocab_size(),
        "token_dtype": "uint16",
        "bos_token_id": tok.token_to_id(bpe.BOS),
        "eos_token_id": eos_id,
        "pad_token_id": tok.token_to_id(bpe.PAD),
        "model_max_length": model_max_length,
        "num_tokens": {s: int(v.size) for s, v in streams.items()},
        "num_docs": {corpus.TRAIN: len(train_texts), corpus.VAL: len(val_texts)},
        "num_bytes": {
            corpus.TRAIN: sum(len(t.encode("utf-8")) for t in train_texts),
            corpus.VAL: sum(len(t.encode("utf-8")) for t in val_texts),
        },
        "tokenizer_sha256": _sha256_file(os.path.join(tok_dir, "tokenizer.json")),
        "corpus_list_sha256": summary["list_sha256"],
        "python_version": summary["python_version"],
        "seconds": {"list": round(t1 - t0, 2), "tokenizer": round(t2 - t1, 2), "encode": round(t3 - t2, 2)},
    }
    meta["bytes_per_token"] = {
        s: round(meta["num_bytes"][s] / max(1, meta["num_tokens"][s] - meta["num_docs"][s]), 3) for s in streams
    }
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return meta


def load_meta(data_dir: str) -> dict:
    """meta.json of a prepared directory; a missing one is a ValueError that says to run `prepare`."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise ValueError(f"data: no meta.json in {data_dir!r}; run `python -m tools.train_tiny prepare --out DIR`")
    with open(path) as f:
        return json.load(f)
