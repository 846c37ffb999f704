"""deltaserve: a serving engine for hybrid linear-attention LLMs (Kimi Linear: KDA + MLA + MoE)."""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # imported lazily so that `import deltaserve.core...` stays free of torch and the engine
    if name == "LLM":
        from deltaserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deltaserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from deltaserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
