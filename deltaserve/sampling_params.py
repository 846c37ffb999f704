"""Per-request sampling parameters, with vLLM's names, defaults and meaning.

A plain dataclass (picklable): it travels from the API process to the workers. Every check in
`__post_init__` raises ValueError naming the field, its value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# longest stop string accepted: the detokenizer compares up to this many characters per stop string
# and new token, so the limit keeps the per-token work bounded
MAX_STOP_STRING_CHARS = 4096


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def stop_string_error(where: str, stop: object) -> str | None:
    """Why `stop` cannot be a stop string, as a message naming it `where` ("stop[2]"); None if it can.

    Shared by SamplingParams and the OpenAI request validation so both refuse the same strings.
    """
    if not isinstance(stop, str) or not stop:
        return f"{where}={stop!r}: stop strings must be non-empty strings"
    if len(stop) > MAX_STOP_STRING_CHARS:
        return (
            f"{where} is {len(stop)} characters long; stop strings may be at most "
            f"{MAX_STOP_STRING_CHARS} characters"
        )
    return lone_surrogate_error(where, stop)  # no generated text can contain one


def lone_surrogate_error(where: str, text: str) -> str | None:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which are not text: why `text` is refused,
    naming `where`, or None if it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{where}: the text is not valid Unicode (a lone surrogate {text[e.start]!a} at character {e.start})"
    return None


CACHE_CONTROL_TYPES = ("ephemeral",)


def cache_control_error(where: str, value: object) -> str | None:
    """Why `value` is not a cache_control hint ({"type": "ephemeral"}, as Anthropic's prompt caching and
    Dynamo's agent hints spell it), naming `where`; None if it is one (or None)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in CACHE_CONTROL_TYPES or set(value) != {"type"}:
        return (f"{where}={value!r}: cache_control must be {{\"type\": \"ephemeral\"}} (a TTL or other keys are "
                "not supported: the tier keeps a hinted prefix by recency)")
    return None


def wants_cache(params: object) -> bool:
    """Whether a request's SamplingParams carry extra_args["cache_control"] (the offload tier's
    admission hint, --kv-offloading-admission cache_control)."""
    extra = getattr(params, "extra_args", None)
    return bool(extra) and extra.get("cache_control") is not None


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    temperature: 0 (below 1e-5) means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 or -1 turns it off.
    top_p: keep the smallest set of tokens whose probability sums to at least top_p; 1 is off.
    min_p: drop tokens whose probability is below min_p times the most likely token's; 0 is off.
    seed: per-request seed; seeded requests are reproducible whatever they are batched with.
    max_tokens: tokens to generate at most; None means up to max_model_len (resolved by the engine).
    min_tokens: EOS, stop token ids and stop strings are ignored until this many tokens exist.
    stop: strings that end generation (each non-empty, at most 4096 characters, valid Unicode); the
        text is cut before the match (or after it, with include_stop_str_in_output).
    stop_token_ids: tokens that end generation besides EOS; the token stays in token_ids.
    logprobs: return this many top logprobs per generated token, plus the sampled token's (0..20).
    prompt_logprobs: return, for every prompt token after the first, its logprob given the tokens
        before it plus this many top logprobs at that position (0..20), in
        `RequestOutput.prompt_logprobs`. Such a request computes its whole prompt (no prefix-cache hit).
    detokenize: False skips text entirely (text is "", stop strings are not checked).
    extra_args: extensions outside these fields, as vLLM's; "kv_transfer_params" (a dict) drives a KV
        connector under prefill/decode disaggregation (deltaserve/kv_transfer); "cache_control"
        ({"type": "ephemeral"}) asks the offload tier to keep this request's prefix, which matters under
        --kv-offloading-admission cache_control (only hinted requests are saved to the tier then).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._verify()

    def _verify(self) -> None:
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(f"n={self.n!r}: only n=1 is supported; send the prompt several times instead")
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 turns it off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an int, -1 or 0 (off) or >= 1")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 turns it off)")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an int or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens={self.max_tokens!r} must be an int >= 1, or None for up to max_model_len"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} must be an int in [0, {MAX_LOGPROBS}] or None")
        for i, s in enumerate(self.stop):
            message = stop_string_error(f"stop[{i}]", s)
            if message is not None:
                raise ValueError(message)
        for i, t in enumerate(self.stop_token_ids):
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids[{i}]={t!r} must be a non-negative int")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args={self.extra_args!r} must be a dict or None")
        message = cache_control_error('extra_args["cache_control"]', (self.extra_args or {}).get("cache_control"))
        if message is not None:
            raise ValueError(message)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature < _GREEDY_EPS
