"""`evaluate`: held-out loss, bits per byte, the unigram baseline and greedy completions -> one JSON.

For the target (and the draft, when given): nats per token over the whole held-out stream (each
token predicted once, windows of seq_len), bits per UTF-8 byte of the held-out documents, and the
same two numbers for the add-one unigram distribution of the train tokens. Greedy completions
continue the first `completions` function headers (`def ...:` lines) of distinct held-out files.
With a draft: its top-1 agreement with the target. With an Eagle3 head: its acceptance proxy.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tools.train_tiny.data import load_tokens, split_documents
from tools.train_tiny.metrics import bits_per_byte, heldout_loss, top1_agreement, unigram_loss
from tools.train_tiny.models import load_model
from tools.train_tiny.prepare import load_meta
from tools.train_tiny.runtime import autocast, configure_cpu_threads, pick_device

HEADER = re.compile(r"^\s*(async\s+)?def \w+\(.*\)(\s*->\s*[^:]+)?:\s*$")


@dataclass(kw_only=True)
class EvalArgs:
    """Every option of `evaluate`."""

    data: str
    model: str  # the target's export directory
    out: str  # the JSON file to write
    draft: str | None = None
    eagle3: str | None = None  # an eagle3 run directory (holding ckpt/), evaluated against --model
    seq_len: int = 512
    batch_size: int = 16
    max_windows: int | None = None
    completions: int = 5
    max_new_tokens: int = 48
    device: str | None = None
    precision: str = "bf16"
    threads: int | None = None


def function_headers(val_tokens: np.ndarray, tokenizer: Any, eos_id: int, n: int) -> list[str]:
    """The first function header line of each held-out document that has one, up to n.

    The line ends at its colon: a prompt ending in a bare newline would split the "newline +
    indentation" tokens the model was trained on, and it would answer with blank lines.
    """
    headers = []
    for doc in split_documents(val_tokens, eos_id):
        text = tokenizer.decode(doc.tolist())
        line = next((ln for ln in text.splitlines() if HEADER.match(ln)), None)
        if line is not None:
            headers.append(line.rstrip())
        if len(headers) == n:
            break
    return headers


@torch.no_grad()
def greedy_complete(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int, device: torch.device,
    precision: str,
) -> list[int]:
    """Greedy continuation without a cache (a full forward per token: short prompts, any version)."""
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        with autocast(device, precision):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
        token = int(logits.float().argmax())
        if token == eos_id:
            break
        ids.append(token)
        new.append(token)
    return new


def lm_report(model: torch.nn.Module, a: EvalArgs, meta: dict, val: np.ndarray, tok: Any, device) -> dict:
    """Loss, bits per byte and completions of one model."""
    loss, n = heldout_loss(model, val, a.seq_len, a.batch_size, device, a.precision, a.max_windows)
    report: dict[str, Any] = {
        "val_loss_nats_per_token": loss, "val_perplexity": float(np.exp(loss)), "val_tokens_scored": n,
        "val_bits_per_byte": bits_per_byte(loss, meta["num_tokens"]["val"], meta["num_bytes"]["val"]),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    samples = []
    for header in function_headers(val, tok, meta["eos_token_id"], a.completions):
        ids = tok.encode(header, add_special_tokens=False)
        new = greedy_complete(model, ids, a.max_new_tokens, meta["eos_token_id"], device, a.precision)
        samples.append({"prompt": header, "completion": tok.decode(new)})
    report["completions"] = samples
    return report


def evaluate(a: EvalArgs) -> dict[str, Any]:
    """Write a.out (JSON) and return its contents."""
    from transformers import AutoTokenizer

    device = pick_device(a.device)
    configure_cpu_threads(device, a.threads)
    meta = load_meta(a.data)
    val, train = load_tokens(a.data, "val"), load_tokens(a.data, "train")
    tok = AutoTokenizer.from_pretrained(os.path.join(a.data, "tokenizer"))
    uni = unigram_loss(train, val, meta["vocab_size"])
    result: dict[str, Any] = {
        "args": asdict(a),
        "unigram_baseline": {
            "val_loss_nats_per_token": uni,
            "val_bits_per_byte": bits_per_byte(uni, meta["num_tokens"]["val"], meta["num_bytes"]["val"]),
        },
        "data": {k: meta[k] for k in ("num_tokens", "num_bytes", "bytes_per_token", "corpus_list_sha256")},
    }
    target = load_model(a.model).to(device)
    result["target"] = lm_report(target, a, meta, val, tok, device)
    if a.draft:
        draft = load_model(a.draft).to(device)
        result["draft"] = lm_report(draft, a, meta, val, tok, device)
        result["draft"]["top1_agreement_with_target"] = top1_agreement(
            draft, target, val, a.seq_len, a.batch_size, device, a.precision, a.max_windows
        )
    if a.eagle3:
        result["eagle3"] = eagle3_report(a, device)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=2)[:4000], flush=True)
    return result


def eagle3_report(a: EvalArgs, device: torch.device) -> dict[str, float]:
    """The acceptance proxy of an eagle3 run's best head (train_eagle3.HeadTrainer.acceptance)."""
    from tools.train_tiny import checkpoint as ckpt
    from tools.train_tiny.train_eagle3 import Eagle3Args, HeadTrainer

    saved = ckpt.load_state(a.eagle3)["args"]
    args = Eagle3Args(**{**saved, "resume": True, "device": str(device), "threads": a.threads,
                         "target": a.model, "data": a.data, "out": a.eagle3})
    trainer = HeadTrainer(args)
    best = ckpt.load_best(a.eagle3)
    if best is not None:
        trainer.head.load_state_dict(best["model"])
    return trainer.acceptance(a.max_windows)
