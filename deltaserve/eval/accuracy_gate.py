"""The accuracy gate: the trained tiny target's held-out loss and greedy completions through the engine.

Every engine configuration (TP, PP, DCP, P/D, the offload tier, speculation, ...) must reproduce the
reference that the plain engine computed in float32 on the CPU, the way a GSM8K run gates a real
model:

    from deltaserve.eval.accuracy_gate import check, load_reference, measure
    reference = load_reference()                        # beside the installed trained models
    llm = LLM(model=installed_trained_dir(), dtype="float32", device="cpu", ...the feature...)
    check(measure(llm, reference.inputs), reference)    # raises AccuracyGateError with a report

(a) the loss: every window is a prompt with SamplingParams(prompt_logprobs=0, max_tokens=1); the
loss of window w is minus the mean logprob of its tokens 1..T-1, the gate's loss the mean over all
scored tokens. (b) greedy completions of the prompts, max_tokens tokens each (ignore_eos).

Tolerances (`TOLERANCES`, keyword arguments of `check`): float32 on the reference's device differs
only in summation order (chunking, batching, the cache), so the loss agrees to ~1e-6 relative and
1e-4 is the bound; the tokens must be identical. On a GPU (fla's TF32 dots) and in bfloat16 the
loss moves further and greedy argmaxes at near-ties may flip, so those presets bound the loss
more loosely and ask for a share of agreeing tokens instead; their values are estimates until
measured on the H200 (then tighten them here).
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltaserve.eval.reference import (
    GateInputs,
    GatePrompt,
    GateReference,
    GateResult,
    load_reference,
    weights_sha256,
)

__all__ = [
    "AccuracyGateError", "GateInputs", "GatePrompt", "GateReference", "GateReport", "GateResult", "TOLERANCES",
    "check", "compute_reference", "load_reference", "measure",
]

FLOAT32_LOSS_RTOL = 1e-4

TOLERANCES: dict[str, dict[str, Any]] = {
    # the reference's own setting (float32, CPU): summation order only
    "float32-cpu": {"loss_tol": FLOAT32_LOSS_RTOL, "require_same_tokens": True},
    # float32 on a GPU: fla's TF32 dots move logprobs by up to ~1e-2 per token (estimate, not yet measured)
    "float32-gpu": {"loss_tol": 5e-3, "require_same_tokens": False, "min_token_agreement": 0.9},
    # bfloat16 activations: ~3 significant digits per op (estimate, not yet measured)
    "bfloat16": {"loss_tol": 2e-2, "require_same_tokens": False, "min_token_agreement": 0.5},
}


class Generates(Protocol):
    """What the gate needs of an engine: `LLM.generate`'s signature."""

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = True) -> list[Any]: ...


class AccuracyGateError(AssertionError):
    """The engine did not reproduce the reference; str() is the full report."""

    def __init__(self, report: GateReport) -> None:
        super().__init__(report.summary())
        self.report = report


def measure(llm: Generates, inputs: GateInputs) -> GateResult:
    """Score inputs.windows (prompt logprobs) and complete inputs.prompts greedily through `llm`."""
    from deltaserve.sampling_params import SamplingParams

    scored = llm.generate([{"prompt_token_ids": list(w)} for w in inputs.windows],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    window_losses, total, count = [], 0.0, 0
    for w, window, out in zip(range(len(inputs.windows)), inputs.windows, scored, strict=True):
        lps = out.prompt_logprobs
        if lps is None or len(lps) != len(window):
            raise ValueError(f"accuracy gate: window {w} came back without one prompt logprob per token")
        nll = -sum(lps[i][window[i]].logprob for i in range(1, len(window)))
        window_losses.append(nll / (len(window) - 1))
        total += nll
        count += len(window) - 1
    greedy = SamplingParams(temperature=0.0, max_tokens=inputs.max_tokens, ignore_eos=True)
    done = llm.generate([{"prompt_token_ids": list(p.token_ids)} for p in inputs.prompts], greedy, use_tqdm=False)
    return GateResult(loss=total / count, window_losses=window_losses,
                      completions=[list(o.outputs[0].token_ids) for o in done],
                      completion_texts=[o.outputs[0].text for o in done])


@dataclass
class PromptComparison:
    """One prompt's completion against the reference: agreeing = tokens before the first difference."""

    name: str
    first_mismatch: int | None
    agreeing: int
    total: int
    expected: list[int]
    got: list[int]


@dataclass
class GateReport:
    """Every figure of one comparison; `failures` says what broke the tolerances (empty: passed)."""

    loss: float
    reference_loss: float
    loss_rel_err: float
    window_rel_errs: list[float]
    prompts: list[PromptComparison]
    tolerances: dict[str, Any]
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def token_agreement(self) -> float:
        """Agreeing tokens (before each prompt's first difference) over all reference tokens."""
        total = sum(p.total for p in self.prompts)
        return sum(p.agreeing for p in self.prompts) / total if total else 1.0

    def summary(self) -> str:
        worst = max(range(len(self.window_rel_errs)), key=self.window_rel_errs.__getitem__)
        lines = [
            f"accuracy gate {'passed' if self.passed else 'FAILED'} ({self.tolerances})",
            f"  loss {self.loss:.6f} vs reference {self.reference_loss:.6f} nats/token "
            f"(relative error {self.loss_rel_err:.2e}); worst window {worst}: {self.window_rel_errs[worst]:.2e}",
            f"  completions: {sum(p.first_mismatch is None for p in self.prompts)}/{len(self.prompts)} identical, "
            f"token agreement {self.token_agreement:.3f}",
        ]
        for p in self.prompts:
            if p.first_mismatch is not None:
                i = p.first_mismatch
                lines.append(f"    prompt {p.name!r}: first differing token index {i} "
                             f"(reference {p.expected[i:i + 4]}..., got {p.got[i:i + 4]}...)")
        lines += [f"  - {f}" for f in self.failures]
        return "\n".join(lines)


def _first_mismatch(expected: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _rel_err(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def check(
    result: GateResult,
    reference: GateReference,
    loss_tol: float = FLOAT32_LOSS_RTOL,
    require_same_tokens: bool = True,
    min_token_agreement: float = 0.0,
    window_tol: float | None = None,
    raise_on_failure: bool = True,
) -> GateReport:
    """Compare `result` with `reference.result`; raise AccuracyGateError (or return) the report.

    loss_tol: relative bound on the mean loss; window_tol (default loss_tol) on each window's loss.
    require_same_tokens: every completion token equal; min_token_agreement: the least share of
    reference tokens that lie before their prompt's first difference. See TOLERANCES for presets.
    """
    ref = reference.result
    window_tol = loss_tol if window_tol is None else window_tol
    if len(result.window_losses) != len(ref.window_losses) or len(result.completions) != len(ref.completions):
        raise ValueError("accuracy gate: the result was measured on other inputs than the reference's")
    prompts = []
    for p, expected, got in zip(reference.inputs.prompts, ref.completions, result.completions, strict=True):
        first = _first_mismatch(expected, got)
        prompts.append(PromptComparison(p.name, first, len(expected) if first is None else first, len(expected),
                                        expected, got))
    report = GateReport(
        loss=result.loss, reference_loss=ref.loss, loss_rel_err=_rel_err(result.loss, ref.loss),
        window_rel_errs=[_rel_err(a, b) for a, b in zip(result.window_losses, ref.window_losses, strict=True)],
        prompts=prompts,
        tolerances={"loss_tol": loss_tol, "window_tol": window_tol, "require_same_tokens": require_same_tokens,
                    "min_token_agreement": min_token_agreement},
    )
    if report.loss_rel_err > loss_tol:
        report.failures.append(f"loss relative error {report.loss_rel_err:.2e} exceeds loss_tol={loss_tol:g}")
    for w, err in enumerate(report.window_rel_errs):
        if err > window_tol:
            report.failures.append(f"window {w}: loss {result.window_losses[w]:.6f} vs {ref.window_losses[w]:.6f} "
                                   f"(relative error {err:.2e} > window_tol={window_tol:g})")
    if require_same_tokens:
        for p in prompts:
            if p.first_mismatch is not None:
                report.failures.append(f"prompt {p.name!r}: completion differs from token index {p.first_mismatch}")
    if report.token_agreement < min_token_agreement:
        report.failures.append(f"token agreement {report.token_agreement:.3f} < min_token_agreement="
                               f"{min_token_agreement:g}")
    if raise_on_failure and not report.passed:
        raise AccuracyGateError(report)
    return report


def compute_reference(model_dir: str, inputs: GateInputs, info: dict[str, Any] | None = None,
                      **engine_options: Any) -> GateReference:
    """The reference: `measure` on the plain engine in float32 on the CPU, plus provenance in info."""
    import torch

    import deltaserve
    from deltaserve import LLM

    options = {"dtype": "float32", "device": "cpu", **engine_options}
    llm = LLM(model=model_dir, **options)
    result = measure(llm, inputs)
    provenance = {
        "weights_sha256": weights_sha256(model_dir),
        "engine": f"deltaserve {deltaserve.__version__}",
        "engine_options": options,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
        **(info or {}),
    }
    return GateReference(inputs, result, provenance)
