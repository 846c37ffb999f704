"""Reading and writing safetensors checkpoints: one `model.safetensors` or index-described shards."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch

from deltaserve.config.model_config import KimiLinearConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
PROGRESS_MIN_BYTES = 1024**3  # progress=None shows a bar from this checkpoint size on


def _read_index(model_dir: str) -> dict[str, str]:
    path = os.path.join(model_dir, INDEX_FILE)
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint: {path} is not a readable safetensors index ({e!r})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"checkpoint: {path} has an empty or malformed weight_map")
    return weight_map


def list_checkpoint_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files (full paths).

    The index's shards when model.safetensors.index.json exists, else model.safetensors, else *.safetensors.
    """
    if not os.path.isdir(model_dir):
        raise ValueError(f"checkpoint: {model_dir!r} is not a directory")
    if os.path.isfile(os.path.join(model_dir, INDEX_FILE)):
        files = []
        for shard in dict.fromkeys(_read_index(model_dir).values()):
            path = os.path.join(model_dir, shard)
            if not os.path.isfile(path):
                raise ValueError(
                    f"checkpoint: {INDEX_FILE} in {model_dir!r} names shard {shard!r}, which is missing"
                )
            files.append(path)
        return sorted(files)
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint: no *.safetensors files in {model_dir!r}")
    return files


def _open(path: str, device: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device=device)
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        raise ValueError(f"checkpoint: {path} is not a readable safetensors file ({e})") from e


def iter_checkpoint_tensors(
    model_dir: str, device: str | torch.device = "cpu", progress: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, file by file, each file in its stored order.

    progress: True forces a tqdm bar over tensors, False hides it, None shows it from 1 GiB on.
    A missing directory or shard is a ValueError at once; an unreadable file or a tensor the
    index assigns to a shard that lacks it, a ValueError while iterating.
    """
    files = list_checkpoint_files(model_dir)
    device = str(device)
    expected: dict[str, set[str]] = {}
    if os.path.isfile(os.path.join(model_dir, INDEX_FILE)):
        for name, shard in _read_index(model_dir).items():
            expected.setdefault(os.path.join(model_dir, shard), set()).add(name)
    if progress is None:
        progress = sum(os.path.getsize(f) for f in files) >= PROGRESS_MIN_BYTES
    return _iter_files(files, device, expected, progress)


def _iter_files(
    files: list[str], device: str, expected: dict[str, set[str]], progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = 0
        for path in files:
            with _open(path, "cpu") as f:
                total += len(f.keys())
        bar = tqdm(total=total, desc="Loading checkpoint", unit="tensor")
    try:
        for path in files:
            with _open(path, device) as f:
                names = list(f.keys())
                missing = expected.get(path, set()) - set(names)
                if missing:
                    raise ValueError(
                        f"checkpoint: {INDEX_FILE} puts {sorted(missing)[0]!r} in {path}, which lacks it"
                    )
                for name in names:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:
                        raise ValueError(f"checkpoint: cannot read {name!r} from {path} ({e})") from e
                    yield name, tensor
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _remove_old_weights(out_dir: str) -> None:
    for path in glob.glob(os.path.join(out_dir, "model*.safetensors")) + [os.path.join(out_dir, INDEX_FILE)]:
        if os.path.isfile(path):
            os.remove(path)


def write_config(out_dir: str, config: KimiLinearConfig) -> None:
    """config.json (the hub spelling) and generation_config.json (bos / eos / pad)."""
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_hub_dict(), f, indent=2)
        f.write("\n")
    eos = list(config.eos_token_id)
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": config.pad_token_id,
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v not in (None, [])}, f, indent=2)
        f.write("\n")


def write_checkpoint(
    out_dir: str,
    config: KimiLinearConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write config.json, generation_config.json and the weights; returns the weight files' paths.

    Streams: at most one shard (up to max_shard_bytes, or one larger tensor) is held on the CPU.
    One shard is written as model.safetensors, more as model-0000i-of-0000N.safetensors plus
    model.safetensors.index.json. Weight files already in out_dir are removed first.
    """
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"checkpoint: max_shard_bytes={max_shard_bytes} must be positive")
    os.makedirs(out_dir, exist_ok=True)
    _remove_old_weights(out_dir)
    shards: list[tuple[str, list[str]]] = []  # (temporary path, tensor names)
    seen: set[str] = set()
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        path = os.path.join(out_dir, f"model-partial-{len(shards):05d}.safetensors")
        save_file(shard, path, metadata={"format": "pt"})
        shards.append((path, list(shard)))
        shard.clear()

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"checkpoint: tensor {name!r} was given twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != nbytes:  # a view into a larger storage: save only its bytes
            t = t.clone()
        shard[name] = t
        shard_bytes += nbytes
        total_bytes += nbytes
    if shard or not shards:
        flush()

    if len(shards) == 1:
        final = [os.path.join(out_dir, SINGLE_FILE)]
    else:
        n = len(shards)
        final = [os.path.join(out_dir, f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
    weight_map: dict[str, str] = {}
    for (tmp, names), path in zip(shards, final, strict=True):
        os.replace(tmp, path)
        weight_map.update({name: os.path.basename(path) for name in names})
    if len(final) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    write_config(out_dir, config)
    return final
