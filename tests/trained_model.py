"""The installed trained tiny target for tests: its directory, the gate's reference, transformers' copy.

Tests skip when no weights are installed (`deltaserve/model_files/trained/`, or the directory
$DELTASERVE_TRAINED_DIR names: `python -m tools.train_tiny install --dest DIR` puts a stand-in there).
"""

from __future__ import annotations

import pytest

from deltaserve.eval.reference import GateReference, load_reference, weights_sha256
from deltaserve.model_files.default_model import TRAINED_DIR_ENV, installed_trained_dir, reference_path, trained_path

SKIP_REASON = (f"no trained target weights in {trained_path('target')} (install them with `python -m tools.train_tiny "
               f"install`, or set ${TRAINED_DIR_ENV})")


def trained_target_or_skip() -> str:
    """The installed trained target's directory; skips the test when there is none."""
    path = installed_trained_dir("target")
    if path is None:
        pytest.skip(SKIP_REASON)
    return path


def reference_or_skip() -> tuple[str, GateReference]:
    """(target dir, reference.json) of the installed trained models; the reference must be of these weights."""
    model_dir = trained_target_or_skip()
    reference = load_reference(reference_path())
    assert reference.info["weights_sha256"] == weights_sha256(model_dir), (
        f"{reference_path()} was computed for other weights; rerun `python -m tools.train_tiny install`")
    return model_dir, reference


def load_hf_trained(model_dir: str):
    """transformers' KimiLinearForCausalLM of the trained target, in float32 on the CPU (fla kept out)."""
    import torch
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def heldout_prompts(reference: GateReference, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given lengths cut from the reference's held-out windows (joined when one is short)."""
    stream = [t for w in reference.inputs.windows for t in w]
    prompts, start = [], 0
    for n in lengths:
        if start + n > len(stream):
            start = 0
        prompts.append(stream[start:start + n])
        start += n
    return prompts
