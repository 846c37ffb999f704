"""fla-core's autotuned kernel configs: shipped per GPU, so a fresh process does not re-tune.

fla's Triton kernels autotune on first use for each model shape, which takes minutes on a fresh
machine. fla can instead read the best configs from `{kernel_name}.json` files in FLA_CONFIG_DIR
(FLA_CACHE_MODE=strict: an exact match on the shape key, else the autotune runs as usual). This
module points fla at the files shipped in `fla_tuned/<GPU name>/` (written by `dump_autotune_results`
after a tuning run, e.g. the H200 benchmark) unless the user has set FLA_CONFIG_DIR or FLA_CACHE_MODE.
It must run before fla is imported: fla reads both variables at import.
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path

TUNED_DIR = Path(__file__).resolve().parent / "fla_tuned"


def gpu_dir_name(device_name: str) -> str:
    """fla's directory name for a GPU ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def use_shipped_configs(mode: str = "strict") -> Path | None:
    """Set FLA_CONFIG_DIR / FLA_CACHE_MODE (`mode`, one of fla's FlaCacheMode values) for this GPU's
    shipped configs; the directory, or None.

    The engine uses "strict": a shape the files do not hold autotunes, so it gets its own best config.
    The GPU tests use "fuzzy" (an entry of the same dtypes and key structure whatever its sizes), so
    their small shapes run with a shipped config instead of autotuning each one for minutes."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    directory = TUNED_DIR / gpu_dir_name(torch.cuda.get_device_name(0))
    if not any(directory.glob("*.json")):
        return None
    os.environ["FLA_CONFIG_DIR"] = str(directory)
    os.environ["FLA_CACHE_MODE"] = mode
    return directory


def dump_autotune_results(out_dir: str | os.PathLike) -> int:
    """Write every fla autotuner's chosen configs in this process to `out_dir/{kernel}.json`.

    Entries are keyed as fla looks them up (md5 of the serialised shape key). Returns the number of
    entries written.
    """
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for tuner in (o for o in gc.get_objects() if isinstance(o, CachedAutotuner)):
        if not tuner.cache:
            continue
        path = out / f"{tuner.kernel_name}.json"
        data = json.loads(path.read_text()) if path.exists() else {"kernel_name": tuner.kernel_name}
        entries = data.setdefault("autotune_entries", {})
        for key, cfg in tuner.cache.items():
            entries[AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(key),
                "config": {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                           "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)},
            }
            written += 1
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return written
