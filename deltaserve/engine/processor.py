"""Input processing: what a request needs before it may reach the engine core.

Tokenize the prompt, check every token id and sampling option against the model, and resolve
max_tokens. It runs where the request arrives (the offline `LLMEngine`, or an API front-end process),
so bad input is refused before the engine loop sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.engine.core import EngineCoreRequest
from deltaserve.model_files.default_model import default_model_dir
from deltaserve.model_files.random_model import random_model_config, random_model_tokenizer, random_preset_name
from deltaserve.model_files.tokenizer import load_tokenizer
from deltaserve.sampling_params import SamplingParams, lone_surrogate_error

PromptInput = str | Sequence[int] | dict[str, Any]


@dataclass
class ModelInfo:
    """What both sides of the engine need to know about the checkpoint, resolved once."""

    model_dir: str
    model_config: KimiLinearConfig
    tokenizer: Any | None
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, config: EngineConfig) -> ModelInfo:
        model_dir = config.model or default_model_dir()  # the trained tiny target, else random tiny
        if random_preset_name(model_dir) is not None:  # random:<preset>, built in memory by the worker
            model_config = random_model_config(model_dir)
            tokenizer = (load_tokenizer(config.tokenizer, config.trust_remote_code) if config.tokenizer
                         else random_model_tokenizer(model_config))
        else:
            model_config = KimiLinearConfig.from_pretrained(model_dir)
            tokenizer = load_tokenizer(config.tokenizer or model_dir, config.trust_remote_code)
        model_max = model_config.max_position_embeddings
        max_model_len = model_max if config.max_model_len is None else config.max_model_len
        if max_model_len > model_max:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum context {model_max}")
        eos = set(model_config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        return cls(model_dir, model_config, tokenizer, max_model_len, tuple(sorted(eos)))


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token can stand for: its longest vocabulary entry. Byte-level BPE
    entries hold one symbol per byte and SentencePiece entries one per character, so no token
    decodes to more characters than its entry is long."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


class InputProcessor:
    """Turns (prompt, SamplingParams) into an `EngineCoreRequest`, or raises ValueError naming the field.

    A text prompt longer than `max_prompt_chars` cannot fit in max_model_len tokens whatever it
    tokenizes to, so it is refused before tokenization, whose time and memory grow with its length.
    """

    def __init__(self, info: ModelInfo, max_logprobs: int) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.vocab_size = info.model_config.vocab_size
        self.max_model_len = info.max_model_len
        self.max_logprobs = max_logprobs
        self.chars_per_token = max_chars_per_token(self.tokenizer) if self.tokenizer is not None else 0
        self.max_prompt_chars = self.chars_per_token * (self.max_model_len - 1)

    def check_text_length(self, text: str, field: str = "prompt") -> None:
        """Refuse text too long to fit in the context as any tokenization of it (ValueError naming `field`)."""
        if self.tokenizer is not None and len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {len(text)} characters cannot fit in max_model_len={self.max_model_len} tokens (no "
                f"token of this tokenizer is longer than {self.chars_per_token} characters, so at most "
                f"{self.max_prompt_chars} fit); shorten the prompt"
            )

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """A string, {"prompt_token_ids": [...]}, {"prompt": "..."} or a list of ids -> (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            message = lone_surrogate_error("prompt", prompt)
            if message is not None:
                raise ValueError(message)
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: this checkpoint has no tokenizer; pass token ids ({'prompt_token_ids': [...]})"
                )
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field when a request cannot be served. Changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if not token_ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        if len(token_ids) >= self.max_model_len:  # before the per-id checks, whose time grows with the length
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len="
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        vocab = self.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} exceeds max_logprobs={self.max_logprobs}")
        for t in params.stop_token_ids or ():
            if not 0 <= t < vocab:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})")

    def process(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                arrival_time: float | None = None) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate; max_tokens=None becomes the room left in the context."""
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate(token_ids, params)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        req = EngineCoreRequest(request_id, token_ids, params, max_tokens)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return text, req
