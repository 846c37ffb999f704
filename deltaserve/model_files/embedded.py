"""The tiny preset, made once per seed into a cache directory and reused: the engine's default model."""

from __future__ import annotations

import os
import shutil
import tempfile

CACHE_ENV = "DELTASERVE_CACHE"


def make_model(preset: str, out_dir: str, seed: int = 0) -> str:
    """`make_model.make_model`, imported on first use: finding the cached model needs no torch."""
    from deltaserve.model_files import make_model as maker

    return maker.make_model(preset, out_dir, seed=seed)


def cache_root() -> str:
    """$DELTASERVE_CACHE, or ~/.cache/deltaserve."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "deltaserve")


def embedded_model_dir(seed: int = 0) -> str:
    """The path of the `tiny` preset with random weights of `seed`, made on first use.

    The model is written into a temporary directory beside the final one and renamed into place,
    so readers never see a half-written model and two processes racing both end up with one.
    """
    root = cache_root()
    final = os.path.join(root, f"tiny-seed{seed}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tiny-seed{seed}-", dir=root)
    try:
        make_model("tiny", tmp, seed=seed)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, final)  # fails if another process put a (non-empty) directory there first
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise ValueError(
                    f"embedded model: {final!r} exists but holds no config.json; delete it to have it remade"
                ) from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
