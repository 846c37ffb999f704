"""The corpus: the `.py` files of the running interpreter's standard library, minus tests and data.

Paths are relative to sysconfig's `stdlib` directory, '/'-separated. A file is kept when it
- is a regular file ending in `.py` that decodes as UTF-8;
- has no directory component in EXCLUDED_DIR_NAMES (test suites: `test/`, `tests/`, `idle_test/`,
  which covers `idlelib/idle_test` and `lib2to3/tests`; `site-packages`; `__pycache__`);
- is not under EXCLUDED_PREFIXES (`pydoc_data/`: generated help text; `ensurepip/_bundled/`: vendored
  wheels) nor in a `config-*` build directory, nor a generated `_sysconfigdata_*.py`;
- is not a generated codec table (`encodings/*.py` containing `decoding_table`, made by gencodec.py).

The held-out split is by path: a file is "val" when the first 8 hex digits of sha256(relpath),
as an integer, modulo 10,000 are below `held_out_per_10k` (300: about 3% of the files, 2% of the bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from collections import Counter
from dataclasses import dataclass

EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
EXCLUDED_PREFIXES = ("pydoc_data/", "ensurepip/_bundled/")
DEFAULT_HELD_OUT_PER_10K = 300
TRAIN, VAL = "train", "val"


@dataclass(frozen=True)
class CorpusFile:
    """One selected source file."""

    relpath: str
    sha256: str
    num_bytes: int
    split: str  # TRAIN or VAL


def stdlib_dir() -> str:
    """The running interpreter's standard-library directory (sysconfig's `stdlib` path)."""
    return sysconfig.get_paths()["stdlib"]


def split_of(relpath: str, held_out_per_10k: int = DEFAULT_HELD_OUT_PER_10K) -> str:
    """TRAIN or VAL for a relative path; depends on nothing but the path."""
    bucket = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % 10_000
    return VAL if bucket < held_out_per_10k else TRAIN


def exclusion_reason(relpath: str, text: str | None) -> str | None:
    """Why `relpath` is left out (a short rule name), or None when it is kept.

    text: the file decoded as UTF-8, or None when it does not decode.
    """
    parts = relpath.split("/")
    for name in parts[:-1]:
        if name in EXCLUDED_DIR_NAMES:
            return f"dir:{name}"
    if any(relpath.startswith(p) for p in EXCLUDED_PREFIXES):
        return "data_dir"
    if parts[0].startswith("config-"):
        return "build_config"
    if parts[-1].startswith("_sysconfigdata_"):
        return "generated_sysconfigdata"
    if text is None:
        return "not_utf8"
    if parts[0] == "encodings" and "decoding_table" in text:
        return "codec_table"
    return None


def _read_text(path: str) -> tuple[bytes, str | None]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw, None


def select_files(
    root: str, held_out_per_10k: int = DEFAULT_HELD_OUT_PER_10K
) -> tuple[list[CorpusFile], dict[str, int]]:
    """The kept files under `root`, sorted by relpath, and a count of the left-out ones per rule."""
    kept: list[CorpusFile] = []
    excluded: Counter[str] = Counter()
    for dirpath, dirnames, filenames in os.walk(root):
        # prune whole excluded trees (site-packages alone holds most of the files on a typical install)
        dropped = [d for d in dirnames if d in EXCLUDED_DIR_NAMES]
        for d in dropped:
            excluded[f"dir:{d}"] += 1
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIR_NAMES)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            relpath = os.path.relpath(path, root).replace(os.sep, "/")
            raw, text = _read_text(path)
            reason = exclusion_reason(relpath, text)
            if reason is not None:
                excluded[reason] += 1
                continue
            digest = hashlib.sha256(raw).hexdigest()
            kept.append(CorpusFile(relpath, digest, len(raw), split_of(relpath, held_out_per_10k)))
    kept.sort(key=lambda f: f.relpath)
    return kept, dict(sorted(excluded.items()))


def manifest_lines(files: list[CorpusFile]) -> list[str]:
    """`<sha256>  <split>  <bytes>  <relpath>` per file, in relpath order."""
    return [f"{f.sha256}  {f.split}  {f.num_bytes}  {f.relpath}" for f in files]


def write_manifest(
    files: list[CorpusFile], excluded: dict[str, int], root: str, out_txt: str, held_out_per_10k: int
) -> dict:
    """Write the file list to `out_txt` and its summary (with the list's sha256) beside it as .json.

    Returns the summary dict.
    """
    text = "\n".join(manifest_lines(files)) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(out_txt)), exist_ok=True)
    with open(out_txt, "w", encoding="utf-8") as f:
        f.write(text)
    summary = {
        "list_file": os.path.basename(out_txt),
        "list_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": root,
        "held_out_per_10k": held_out_per_10k,
        "num_files": len(files),
        "num_files_train": sum(f.split == TRAIN for f in files),
        "num_files_val": sum(f.split == VAL for f in files),
        "num_bytes_train": sum(f.num_bytes for f in files if f.split == TRAIN),
        "num_bytes_val": sum(f.num_bytes for f in files if f.split == VAL),
        "excluded": excluded,
        "excluded_note": "dir:* counts pruned directories (whole trees); the other rules count files",
        "rules": {
            "excluded_dir_names": sorted(EXCLUDED_DIR_NAMES),
            "excluded_prefixes": list(EXCLUDED_PREFIXES),
            "also": ["config-*/ build data", "_sysconfigdata_*.py", "encodings/*.py with decoding_table", "non-UTF-8"],
        },
    }
    with open(os.path.splitext(out_txt)[0] + ".json", "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    return summary


def read_texts(root: str, files: list[CorpusFile]) -> list[str]:
    """The files' contents, checked against the recorded sha256 (a changed file is a ValueError)."""
    texts = []
    for cf in files:
        raw, text = _read_text(os.path.join(root, cf.relpath))
        if hashlib.sha256(raw).hexdigest() != cf.sha256 or text is None:
            raise ValueError(f"corpus: {cf.relpath} changed since it was listed (sha256 differs)")
        texts.append(text)
    return texts
