"""The accuracy gate under tensor, pipeline and decode context parallelism: the trained tiny target
served by the multi-process executor (gloo, float32, CPU) reproduces reference.json (the plain
engine's figures) within the float32 preset: the loss to 1e-4 relative and every greedy token.

Skipped without installed trained weights (tests/trained_model.py).
"""

from __future__ import annotations

import pytest
from trained_model import reference_or_skip

from deltaserve import LLM
from deltaserve.eval.accuracy_gate import TOLERANCES, check, measure

WORLDS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2_pp2_inflight3": dict(tensor_parallel_size=2, pipeline_parallel_size=2, pp_max_inflight=3),
    "tp2_dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
}


@pytest.mark.parametrize("world", list(WORLDS))
def test_parallel_engine_passes_the_gate(world):
    model_dir, reference = reference_or_skip()
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=128, **WORLDS[world])
    try:
        report = check(measure(llm, reference.inputs), reference, **TOLERANCES["float32-cpu"])
    finally:
        llm.shutdown()
    assert report.token_agreement == 1.0
