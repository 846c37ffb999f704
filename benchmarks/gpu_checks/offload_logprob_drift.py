"""How far CUDA float32 logprobs move with prefix caching alone and with the offload tier, against an engine
without caching, on the offload engine test's sessions (tests/offload/test_offload_engine.py). Prints the
largest logprob difference and whether greedy tokens agree, per configuration.
usage: python benchmarks/gpu_checks/offload_logprob_drift.py   (from the repository root, on a GPU)"""

import sys
import tempfile

sys.path[:0] = ["tests"]
from hf_reference import tiny_hub_config  # noqa: E402
from offload.test_offload_engine import COMMON, SMALL_HBM, TIER  # noqa: E402

from deltaserve import LLM  # noqa: E402


def drift(want, got):
    """Largest |logprob difference| over the tokens before each request's first token divergence, and
    how many requests part."""
    worst, parted = 0.0, 0
    for a, b in zip(want, got, strict=True):
        for ta, tb, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids, a.outputs[0].logprobs,
                                  b.outputs[0].logprobs, strict=True):
            if ta != tb:
                parted += 1
                break
            worst = max(worst, abs(la[ta].logprob - lb[tb].logprob))
    return worst, parted


def main():
    import pathlib

    import torch
    from hf_reference import checkpoint_dir, random_prompts
    from offload.test_offload_engine import SESSIONS, TURNS

    from deltaserve import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        class Factory:
            def mktemp(self, name):
                path = pathlib.Path(tmp) / name
                path.mkdir()
                return path

        model_dir, _ = checkpoint_dir(Factory(), "offload", tiny_hub_config(), seed=41)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
        cpu = LLM(model=model_dir, enable_prefix_caching=False, **COMMON)
        system = random_prompts([70], 320, seed=1)[0]
        messages = random_prompts([5 + 9 * i for i in range(SESSIONS * (TURNS + 1))], 320, seed=2)
        prompts = [system + messages[s] for s in range(SESSIONS)]
        turns, wants = [], []
        for turn in range(TURNS):  # each turn's prompts fixed from the CPU's answers
            want = cpu.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            turns.append(prompts)
            wants.append(want)
            prompts = [p + w.outputs[0].token_ids + messages[(turn + 1) * SESSIONS + s]
                       for s, (p, w) in enumerate(zip(prompts, want, strict=True))]
        gpu = dict(COMMON, device="cuda", enforce_eager=True, cache_memory="64MiB")
        runs = {"plain": dict(enable_prefix_caching=False), "caching roomy": {}, "caching small": dict(SMALL_HBM),
                "caching small+tier": dict(SMALL_HBM, **TIER, kv_offloading_size="64MiB")}
        print(f"{'tf32':>5} {'config':>20} " + " ".join(f"{'turn ' + str(t) + ' max|d| / parted':>24}"
                                                      for t in range(TURNS)), flush=True)
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            for name, extra in runs.items():
                llm = LLM(model=model_dir, **{**gpu, **extra})
                cells = []
                for prompts, want in zip(turns, wants, strict=True):
                    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                    worst, parted = drift(want, got)
                    cells.append(f"{worst:>8.4f} / {parted}")
                llm.shutdown()
                print(f"{tf32!s:>5} {name:>20} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
