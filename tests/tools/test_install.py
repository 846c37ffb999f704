"""`python -m tools.train_tiny install` on a micro run: the checks, the copy, and reference.json, which
the engine then reproduces through the accuracy gate."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `tools` is a namespace package at the repository root
    sys.path.insert(0, str(ROOT))

from deltaserve.eval.accuracy_gate import check, measure  # noqa: E402
from deltaserve.eval.reference import load_reference, weights_sha256  # noqa: E402
from deltaserve.model.eagle3 import Eagle3Config, Eagle3Head, save_eagle3  # noqa: E402
from tools.train_tiny import install as installer  # noqa: E402
from tools.train_tiny.install import InstallArgs, check_export, install  # noqa: E402
from tools.train_tiny.prepare import prepare  # noqa: E402
from tools.train_tiny.train import TrainArgs, train  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A runs directory as gpu_run.sh leaves it: micro target and draft exports, a small Eagle3 head."""
    before = torch.get_num_threads()
    root = tmp_path_factory.mktemp("install")
    data = str(root / "data")
    prepare(data, vocab_size=320, max_files=4)
    runs = root / "runs"
    for role in ("target", "draft"):
        train(TrainArgs(data=data, out=str(runs / role), model="micro", batch_size=2, seq_len=32, lr=1e-2,
                        warmup_steps=2, max_steps=4, eval_every=4, eval_windows=1, device="cpu"))
    torch.set_num_threads(before)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(vocab_size=320, hidden_size=16, target_hidden_size=64, tap_layer_ids=(0, 1, 2),
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                                   target_num_hidden_layers=3))
    save_eagle3(head, str(runs / "eagle3" / "export"))
    (runs / "eval.json").write_text("{}\n")
    return data, runs


def _args(data, runs, dest, **kw) -> InstallArgs:
    return InstallArgs(runs=str(runs), data=data, dest=str(dest), windows=3, window_len=48, headers=2,
                       long_prompts=1, long_prompt_len=40, max_tokens=6, **kw)


def test_install_copies_the_exports_and_the_engine_reproduces_its_reference(runs, tmp_path):
    data, run_dir = runs
    summary = install(_args(data, run_dir, tmp_path / "trained"))
    dest = tmp_path / "trained"
    assert {p.name for p in dest.iterdir()} == {"target", "draft", "eagle3", "eval.json", "reference.json"}
    assert "model.safetensors" in os.listdir(dest / "target") and "tokenizer.json" in os.listdir(dest / "draft")
    reference = load_reference(str(dest / "reference.json"))
    assert reference.info["weights_sha256"] == weights_sha256(str(dest / "target"))
    assert len(reference.inputs.windows) == 3 and all(len(w) == 48 for w in reference.inputs.windows)
    assert reference.inputs.prompts[-1].name == "window 0 [:40]"
    assert all(len(c) == 6 for c in reference.result.completions)
    assert summary["reference"]["bytes"] < installer.MAX_REFERENCE_BYTES
    from deltaserve import LLM

    llm = LLM(model=str(dest / "target"), dtype="float32", device="cpu", max_num_batched_tokens=16)
    check(measure(llm, reference.inputs), reference)
    install(_args(data, run_dir, dest, roles="target"))  # installing again replaces, and keeps the rest
    assert (dest / "draft").is_dir() and not any(p.name.endswith((".staged", ".old")) for p in dest.iterdir())


def test_install_refuses_float32_weights_and_large_shards(runs, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    _, run_dir = runs
    export = tmp_path / "export"
    shutil.copytree(run_dir / "target" / "export", export)
    weights = load_file(str(export / "model.safetensors"))
    assert check_export("target", str(export))
    monkeypatch.setattr(installer, "MAX_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"model.safetensors is [\d,]+ bytes, not under 1,000"):
        check_export("target", str(export))
    monkeypatch.undo()
    weights["lm_head.weight"] = weights["lm_head.weight"].float()
    save_file(weights, str(export / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' in model.safetensors is F32; expected BF16"):
        check_export("target", str(export))
    with pytest.raises(ValueError, match="no config.json"):
        check_export("draft", str(tmp_path))
