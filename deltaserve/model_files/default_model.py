"""Where the trained tiny models live, and the engine's default model.

The package directory `deltaserve/model_files/trained/` holds the trained tiny Kimi Linear of
issue 14 (`tools/train_tiny`): `target/` and `draft/` (Hugging Face `save_pretrained` exports),
`eagle3/` (the Eagle3 head) and `reference.json` (the accuracy gate's held-out windows and the
figures the engine computes on them; see `deltaserve.eval.accuracy_gate`). They are package data,
so an editable install and a wheel both carry them. `python -m tools.train_tiny install` puts them
there. $DELTASERVE_TRAINED_DIR points at another directory of the same layout instead.

With no `--model` the engine serves the trained target; while no weights are installed it falls
back to the random `tiny` preset (the embedded model) and says so once. The random presets stay
reachable by name: `random:tiny` (built in memory) or `embedded.embedded_model_dir()` (on disk).
"""

from __future__ import annotations

import glob
import logging
import os

from deltaserve.model_files.embedded import embedded_model_dir

logger = logging.getLogger(__name__)

TRAINED_DIR_ENV = "DELTASERVE_TRAINED_DIR"
PACKAGE_TRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trained")
ROLES = ("target", "draft", "eagle3")
REFERENCE_FILE = "reference.json"

_warned = False


def trained_root() -> str:
    """$DELTASERVE_TRAINED_DIR, or the package's `trained/` directory."""
    return os.environ.get(TRAINED_DIR_ENV) or PACKAGE_TRAINED_DIR


def trained_path(role: str = "target") -> str:
    """The directory of `role` (target, draft or eagle3) under `trained_root()`, present or not."""
    if role not in ROLES:
        raise ValueError(f"trained model role={role!r} is not known; choose one of {', '.join(ROLES)}")
    return os.path.join(trained_root(), role)


def has_weights(model_dir: str) -> bool:
    """True when `model_dir` holds a config.json and at least one *.safetensors file."""
    return os.path.isfile(os.path.join(model_dir, "config.json")) and bool(
        glob.glob(os.path.join(model_dir, "*.safetensors"))
    )


def installed_trained_dir(role: str = "target") -> str | None:
    """The trained `role`'s directory when its weights are installed, else None."""
    path = trained_path(role)
    return path if has_weights(path) else None


def reference_path() -> str:
    """The accuracy gate's reference.json beside the trained models (present or not)."""
    return os.path.join(trained_root(), REFERENCE_FILE)


def default_model_dir() -> str:
    """The model the engine serves when none is named: the trained target, else the random tiny preset.

    The fallback logs one warning per process, naming where the weights were looked for.
    """
    global _warned
    path = installed_trained_dir("target")
    if path is not None:
        return path
    if not _warned:
        _warned = True
        logger.warning("no trained model weights in %s; serving the random tiny preset (random weights)",
                       trained_path("target"))
    return embedded_model_dir()
