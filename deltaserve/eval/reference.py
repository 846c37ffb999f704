"""The accuracy gate's reference file: fixed held-out inputs and the figures the engine computed on them.

reference.json (format 1) ships beside the trained models in `deltaserve/model_files/trained/` (package data):

    info     provenance: the weights' sha256, dtype, device, versions, date, where the inputs came from
    inputs   windows: held-out token windows [W][T] scored for their loss; prompts: named token-id
             prompts (held-out function headers, long window prefixes) completed greedily for
             max_tokens tokens with ignore_eos
    result   loss (nats per scored token over every window), window_losses [W], completions [P][max_tokens]
             and their text

The data directory the windows come from is not shipped, so the token ids are stored here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = 1


@dataclass(frozen=True)
class GatePrompt:
    """One greedy-completion prompt: a name for reports (its text, or where it was cut from) and its ids."""

    name: str
    token_ids: list[int]


@dataclass(frozen=True)
class GateInputs:
    """What the gate feeds the engine: windows [W][T] to score, prompts to complete for max_tokens."""

    windows: list[list[int]]
    prompts: list[GatePrompt]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.windows or any(len(w) < 2 for w in self.windows):
            raise ValueError("accuracy gate: inputs.windows needs at least one window of 2 or more tokens")
        if any(not p.token_ids for p in self.prompts):
            raise ValueError("accuracy gate: every prompt needs at least one token id")
        if self.max_tokens < 1:
            raise ValueError(f"accuracy gate: max_tokens={self.max_tokens} must be at least 1")


@dataclass
class GateResult:
    """What one engine configuration produced on the gate's inputs.

    loss: nats per scored token over all windows (positions 1..T-1 of each); window_losses [W];
    completions [P][max_tokens] greedy token ids and completion_texts [P] their text.
    """

    loss: float
    window_losses: list[float]
    completions: list[list[int]]
    completion_texts: list[str]


@dataclass
class GateReference:
    """inputs + the result the engine gave on them in float32 on the CPU + provenance."""

    inputs: GateInputs
    result: GateResult
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "info": self.info, "inputs": asdict(self.inputs), "result": asdict(self.result)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GateReference:
        if d.get("format") != FORMAT:
            raise ValueError(f"accuracy gate: reference format {d.get('format')!r} is not {FORMAT}; recompute it")
        raw = d["inputs"]
        inputs = GateInputs(
            windows=[list(map(int, w)) for w in raw["windows"]],
            prompts=[GatePrompt(p["name"], list(map(int, p["token_ids"]))) for p in raw["prompts"]],
            max_tokens=int(raw["max_tokens"]),
        )
        r = d["result"]
        result = GateResult(float(r["loss"]), [float(x) for x in r["window_losses"]],
                            [list(map(int, c)) for c in r["completions"]], list(r["completion_texts"]))
        if len(result.window_losses) != len(inputs.windows) or len(result.completions) != len(inputs.prompts):
            raise ValueError("accuracy gate: the reference's result does not match its inputs (windows or prompts)")
        return cls(inputs, result, dict(d.get("info", {})))


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:\s*,\s*-?[\d.eE+-]+)*)\s*\]")


def dumps_reference(reference: GateReference) -> str:
    """Indented JSON with every list of numbers on one line (a window per line, small diffs)."""
    text = json.dumps(reference.to_dict(), indent=2, ensure_ascii=False)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def save_reference(reference: GateReference, path: str) -> None:
    """Write reference.json (through a temporary file, so a reader never sees half of it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps_reference(reference))
    os.replace(tmp, path)


def load_reference(path: str | None = None) -> GateReference:
    """The reference at `path`, by default the one beside the installed trained models."""
    if path is None:
        from deltaserve.model_files.default_model import reference_path

        path = reference_path()
    if not os.path.isfile(path):
        raise ValueError(f"accuracy gate: no reference at {path!r}; run `python -m tools.train_tiny install`")
    with open(path, encoding="utf-8") as f:
        return GateReference.from_dict(json.load(f))


def weights_sha256(model_dir: str) -> str:
    """sha256 over the checkpoint's safetensors files (names and bytes, in name order)."""
    from deltaserve.model_files.checkpoint_io import list_checkpoint_files

    digest = hashlib.sha256()
    for path in sorted(list_checkpoint_files(model_dir)):
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
