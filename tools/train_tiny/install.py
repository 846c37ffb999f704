"""`install`: copy a run's exports into deltaserve's package directory and compute the gate's reference.

    python -m tools.train_tiny install --runs build/train_tiny/runs [--data build/train_tiny/data]

From RUNS: `target/export`, `draft/export`, `eagle3/export` (the roles in --roles) and `eval.json`
when present. Each export is checked before anything is replaced: only *.safetensors, *.json,
*.jinja and *.txt files are taken, every safetensors file is under 16 MiB, every tensor is
bfloat16 except those transformers keeps in float32 (router weight and bias, `dt_bias`), and the
export loads with deltaserve's loader (the head with `load_eagle3`). Then reference.json: held-out
windows from DATA's val stream, held-out function headers and long window prefixes as prompts,
scored and completed by the engine in float32 on the CPU (`deltaserve.eval.accuracy_gate`).

The destination is $DELTASERVE_TRAINED_DIR or `deltaserve/model_files/trained/` (package data).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.train_tiny.checkpoint import KEEP_FP32
from tools.train_tiny.data import load_tokens
from tools.train_tiny.evaluate import function_headers
from tools.train_tiny.prepare import load_meta

MAX_FILE_BYTES = 16 * 1024**2  # the device returns files of at most 16 MiB; the issue asks for shards under it
MAX_REFERENCE_BYTES = 100 * 1024
COPIED_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt")
EXPORT_SUBDIR = {"target": "target/export", "draft": "draft/export", "eagle3": "eagle3/export"}


@dataclass(kw_only=True)
class InstallArgs:
    """Every option of `install`."""

    runs: str  # the runs directory of gpu_run.sh (target/export, draft/export, eagle3/export, eval.json)
    data: str = "build/train_tiny/data"  # the prepared data directory: the gate's windows come from val.bin
    dest: str | None = None  # default: $DELTASERVE_TRAINED_DIR or deltaserve/model_files/trained
    roles: str = "target,draft,eagle3"  # the exports that must be present and are installed
    windows: int = 8  # held-out windows scored for the gate's loss
    window_len: int = 256
    headers: int = 8  # held-out function headers completed greedily
    long_prompts: int = 2  # window prefixes completed greedily (long prompts: chunking, the prefix cache)
    long_prompt_len: int = 192
    max_tokens: int = 24


def _fp32_allowed(name: str) -> bool:
    return any(k in name for k in KEEP_FP32)


def check_export(role: str, export_dir: str) -> list[str]:
    """The file names to copy from `export_dir`; ValueError naming the file or tensor that breaks a rule."""
    from safetensors import safe_open

    if not os.path.isfile(os.path.join(export_dir, "config.json")):
        raise ValueError(f"install: {role}: no config.json in {export_dir!r}; is the run finished and exported?")
    names = sorted(n for n in os.listdir(export_dir) if n.endswith(COPIED_SUFFIXES)
                   and os.path.isfile(os.path.join(export_dir, n)))
    weights = [n for n in names if n.endswith(".safetensors")]
    if not weights:
        raise ValueError(f"install: {role}: no *.safetensors in {export_dir!r}")
    for name in weights:
        path = os.path.join(export_dir, name)
        size = os.path.getsize(path)
        if size >= MAX_FILE_BYTES:
            raise ValueError(f"install: {role}: {name} is {size:,} bytes, not under {MAX_FILE_BYTES:,} (16 MiB); "
                             "export with a smaller max_shard_size")
        with safe_open(path, framework="pt") as f:
            for tensor in f.keys():
                dtype = str(f.get_slice(tensor).get_dtype())
                allowed = ("BF16", "F32") if _fp32_allowed(tensor) else ("BF16",)
                if dtype not in allowed:
                    raise ValueError(f"install: {role}: tensor {tensor!r} in {name} is {dtype}; "
                                     f"expected {' or '.join(allowed)} (a bf16 export)")
    _check_loads(role, export_dir)
    return names


def _check_loads(role: str, model_dir: str) -> None:
    import torch

    if role == "eagle3":
        from deltaserve.model.eagle3 import load_eagle3

        load_eagle3(model_dir)
        return
    from deltaserve.config.model_config import KimiLinearConfig
    from deltaserve.config.parallel import ParallelConfig
    from deltaserve.model.loader import load_model_from_dir
    from deltaserve.model_files.tokenizer import load_tokenizer

    config = KimiLinearConfig.from_pretrained(model_dir)
    load_model_from_dir(model_dir, config, ParallelConfig(), torch.float32, torch.device("cpu"))
    if load_tokenizer(model_dir) is None:
        raise ValueError(f"install: {role}: {model_dir!r} has no tokenizer files")


def _replace_dir(staged: str, final: str) -> None:
    old = final + ".old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(staged, final)
    if os.path.isdir(old):
        shutil.rmtree(old)


def gate_inputs(a: InstallArgs, tokenizer_dir: str) -> Any:
    """The gate's inputs from the data directory: evenly spaced val windows, headers, window prefixes."""
    from transformers import AutoTokenizer

    from deltaserve.eval.reference import GateInputs, GatePrompt

    val = load_tokens(a.data, "val")
    meta = load_meta(a.data)
    span = val.size - a.window_len
    if span < 0 or a.windows < 1:
        raise ValueError(f"install: the val stream has {val.size} tokens, too few for windows of {a.window_len}")
    starts = [i * span // max(a.windows - 1, 1) for i in range(a.windows)]
    windows = [np.asarray(val[s:s + a.window_len], dtype=np.int64).tolist() for s in starts]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = []
    for line in function_headers(val, tok, meta["eos_token_id"], a.headers):
        text = line.strip()
        text = text[: text.index("(") + 1]  # "def parse_args(": the model writes the arguments and the body
        ids = tok.encode(text, add_special_tokens=False)
        if text not in (p.name for p in prompts):
            prompts.append(GatePrompt(text, ids))
    for w in range(min(a.long_prompts, a.windows)):
        n = min(a.long_prompt_len, a.window_len)
        prompts.append(GatePrompt(f"window {w} [:{n}]", windows[w][:n]))
    inputs = GateInputs(windows=windows, prompts=prompts, max_tokens=a.max_tokens)
    source = {"data": "val.bin", "window_starts": starts, "window_len": a.window_len,
              "corpus_list_sha256": meta.get("corpus_list_sha256"), "tokenizer_sha256": meta.get("tokenizer_sha256")}
    return inputs, source


def install(a: InstallArgs) -> dict[str, Any]:
    """Check, copy, compute reference.json; returns a summary (also printed as JSON)."""
    from deltaserve.eval.accuracy_gate import compute_reference
    from deltaserve.eval.reference import save_reference
    from deltaserve.model_files.default_model import trained_root

    dest = a.dest or trained_root()
    roles = [r for r in a.roles.split(",") if r]
    unknown = [r for r in roles if r not in EXPORT_SUBDIR]
    if unknown or "target" not in roles:
        raise ValueError(f"install: roles={a.roles!r} must include target and name only {', '.join(EXPORT_SUBDIR)}")
    checked = {r: check_export(r, os.path.join(a.runs, EXPORT_SUBDIR[r])) for r in roles}
    os.makedirs(dest, exist_ok=True)
    summary: dict[str, Any] = {"dest": dest, "files": {}}
    for role, names in checked.items():
        staged = os.path.join(dest, f".{role}.staged")
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
        for name in names:
            shutil.copyfile(os.path.join(a.runs, EXPORT_SUBDIR[role], name), os.path.join(staged, name))
        _replace_dir(staged, os.path.join(dest, role))
        summary["files"][role] = names
    eval_json = os.path.join(a.runs, "eval.json")
    if os.path.isfile(eval_json):
        shutil.copyfile(eval_json, os.path.join(dest, "eval.json"))
        summary["files"]["eval.json"] = True
    target = os.path.join(dest, "target")
    inputs, source = gate_inputs(a, target)
    reference = compute_reference(target, inputs, info={"inputs_from": source})
    path = os.path.join(dest, "reference.json")
    save_reference(reference, path)
    size = os.path.getsize(path)
    if size > MAX_REFERENCE_BYTES:
        raise ValueError(f"install: {path} is {size:,} bytes, over {MAX_REFERENCE_BYTES:,}; lower --windows")
    summary["reference"] = {"path": path, "bytes": size, "loss": reference.result.loss,
                            "window_losses": reference.result.window_losses,
                            "completions": dict(zip([p.name for p in inputs.prompts],
                                                    reference.result.completion_texts, strict=True))}
    print(json.dumps(summary, indent=2, ensure_ascii=False), flush=True)
    return summary
