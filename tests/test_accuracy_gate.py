"""The accuracy gate: the trained tiny target through the engine (float32, CPU) reproduces reference.json,
whatever the chunking or the prefix cache, and its prompt logprobs equal transformers' log_softmax.

The trained-model tests skip without installed weights (tests/trained_model.py says where they are
looked for); the report tests need none.
"""

from __future__ import annotations

import pytest
import torch
from trained_model import load_hf_trained, reference_or_skip

from deltaserve import LLM, SamplingParams
from deltaserve.eval.accuracy_gate import TOLERANCES, AccuracyGateError, check, measure
from deltaserve.eval.reference import (
    GateInputs,
    GatePrompt,
    GateReference,
    GateResult,
    dumps_reference,
    load_reference,
)

HF_TOL = 1e-4  # float32 on one CPU: test_prompt_logprobs' tolerance


@pytest.fixture(scope="module")
def trained():
    return reference_or_skip()


def test_trained_target_reproduces_the_reference(trained):
    model_dir, reference = trained
    llm = LLM(model=model_dir, dtype="float32", device="cpu")
    report = check(measure(llm, reference.inputs), reference, **TOLERANCES["float32-cpu"])
    assert report.token_agreement == 1.0
    llm.llm_engine.scheduler.check_invariants()


@pytest.mark.parametrize("budget", [37, 100])
def test_chunked_prefill_reproduces_the_reference(trained, budget):
    """37 tokens a step: every window spans several chunks, and chunks end off block boundaries."""
    model_dir, reference = trained
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    check(measure(llm, reference.inputs), reference)


def test_prefix_cache_hits_reproduce_the_reference(trained):
    """The long prompts (window prefixes) hit the blocks and state checkpoints (every 64 tokens) that
    the windows filed, and the second pass hits what the first filed; prompt-logprob windows are
    computed again (no hit) and still agree."""
    model_dir, reference = trained
    llm = LLM(model=model_dir, dtype="float32", device="cpu", enable_prefix_caching=True, max_num_batched_tokens=64,
              state_checkpoint_interval=64, state_checkpoint_fraction=0.9, cache_memory="256MiB")
    # room for every window's checkpoints: a later pass finds them
    check(measure(llm, reference.inputs), reference)
    hits = llm.get_metrics()["prefix_cache"]["hit_tokens"]
    check(measure(llm, reference.inputs), reference)
    assert llm.get_metrics()["prefix_cache"]["hit_tokens"] > hits
    llm.llm_engine.scheduler.check_invariants()


def test_prompt_logprobs_equal_transformers_on_a_heldout_window(trained):
    model_dir, reference = trained
    window = reference.inputs.windows[0]
    with torch.inference_mode():
        expected = torch.log_softmax(load_hf_trained(model_dir)(input_ids=torch.tensor([window])).logits[0].float(), -1)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=50)
    out = llm.generate([{"prompt_token_ids": window}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([out.prompt_logprobs[i][window[i]].logprob for i in range(1, len(window))])
    want = expected[torch.arange(len(window) - 1), torch.tensor(window[1:])]
    assert (got - want).abs().max().item() < HF_TOL
    # the loss of this window, both ways, is the reference's
    assert abs(-want.mean().item() - reference.result.window_losses[0]) < 1e-4 * reference.result.window_losses[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "preset"), [("float32", "float32-gpu"), ("bfloat16", "bfloat16")])
def test_gpu_passes_the_gate_within_its_preset(trained, dtype, preset, record_property):
    """The GPU path (fla's KDA, the Triton MLA kernels; CUDA graphs in bfloat16) against the CPU
    reference, within the preset's tolerances; prints the figures that set those presets."""
    model_dir, reference = trained
    llm = LLM(model=model_dir, dtype=dtype, device="cuda", cache_memory="256MiB")
    report = check(measure(llm, reference.inputs), reference, raise_on_failure=False, **TOLERANCES[preset])
    record_property("gate", report.summary())
    print(f"accuracy gate, {dtype} on {torch.cuda.get_device_name()}: loss_rel_err {report.loss_rel_err:.2e}, "
          f"worst window {max(report.window_rel_errs):.2e}, token agreement {report.token_agreement:.3f}")
    assert report.passed, report.summary()


# the report, on hand-made figures -------------------------------------------------------------------
def _reference() -> GateReference:
    inputs = GateInputs(windows=[[5, 6, 7], [8, 9, 10, 11]], max_tokens=4,
                        prompts=[GatePrompt("def a(", [1, 2]), GatePrompt("def b(", [3])])
    result = GateResult(loss=2.0, window_losses=[1.9, 2.1], completions=[[1, 2, 3, 4], [5, 6, 7, 8]],
                        completion_texts=["abcd", "efgh"])
    return GateReference(inputs, result, {"weights_sha256": "x"})


def test_check_passes_equal_figures_and_reports_agreement():
    ref = _reference()
    report = check(GateResult(2.0 * (1 + 5e-5), [1.9, 2.1], [[1, 2, 3, 4], [5, 6, 7, 8]], ["", ""]), ref)
    assert report.passed and report.token_agreement == 1.0 and "passed" in report.summary()


def test_check_names_the_window_and_the_first_differing_token():
    ref = _reference()
    bad = GateResult(2.01, [1.9, 2.2], [[1, 2, 9, 4], [5, 6, 7, 8]], ["", ""])
    with pytest.raises(AccuracyGateError) as e:
        check(bad, ref)
    text = str(e.value)
    assert "loss relative error 5.00e-03 exceeds loss_tol=0.0001" in text
    assert "window 1: loss 2.200000 vs 2.100000" in text and "window 0" not in text.split("worst window")[1]
    assert "prompt 'def a(': first differing token index 2" in text
    assert e.value.report.token_agreement == pytest.approx(6 / 8)
    # looser presets pass on the loss and count agreeing tokens instead of requiring them all
    report = check(bad, ref, loss_tol=1e-2, window_tol=5e-2, require_same_tokens=False, min_token_agreement=0.7)
    assert report.passed
    report = check(bad, ref, **{**TOLERANCES["bfloat16"], "min_token_agreement": 0.8}, raise_on_failure=False)
    assert not report.passed and "token agreement 0.750 < min_token_agreement=0.8" in report.failures[-1]


def test_reference_round_trips_through_its_file(tmp_path):
    ref = _reference()
    path = tmp_path / "reference.json"
    path.write_text(dumps_reference(ref))
    assert "[5, 6, 7]" in path.read_text()  # a window per line
    back = load_reference(str(path))
    assert back.inputs == ref.inputs and back.result == ref.result and back.info == ref.info
    with pytest.raises(ValueError, match="no reference"):
        load_reference(str(tmp_path / "missing.json"))
