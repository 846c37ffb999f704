"""The speculative decoding options (vLLM's `speculative_config`), validated once when parsed.

`LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})`
or `--speculative-config '{"method": "ngram", ...}'`. Methods: "ngram" (prompt lookup over the request's
own tokens), "draft_model" (a smaller Kimi Linear checkpoint at "model"), "eagle3" (a one-layer drafter
reading the target's hidden states; "model" holds its weights and tap layer ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.config.engine_config import json_object

METHODS = ("ngram", "draft_model", "eagle3")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram window when neither bound is given
_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model / eagle3: the drafter's checkpoint directory
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix matched
    prompt_lookup_max: int | None = None  # ngram: the longest suffix matched

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method={self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens={k!r} must be a positive integer")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' drafts from the request's own tokens; "
                                 f"it takes no model (got {self.model!r})")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = DEFAULT_PROMPT_LOOKUP
            low, high = (high if low is None else low), (low if high is None else high)
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config: {name}={value!r} must be a positive integer")
            if low > high:
                raise ValueError(f"speculative_config: prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not self.model:
                raise ValueError(f"speculative_config: method {self.method!r} needs \"model\": the drafter's "
                                 "checkpoint directory")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max belong to method "
                                 f"'ngram', not {self.method!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a SpeculativeConfig, a dict or its JSON text; ValueError naming what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(_KEYS))}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config needs {required!r}")
        return cls(**value)
