"""Request and response bodies of the OpenAI-compatible API, as pydantic v2 models.

Requests are strict and closed: `"10"` is not an int (an int is a float), unknown fields are rejected as
OpenAI rejects them, and every number is bounded, so a bad value fails here naming the field. Fields the
engine does not implement yet are accepted only at their neutral value, else "<field> is not supported yet".
`format_validation_errors` turns pydantic's errors into the message and param of OpenAI's error body.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from deltaserve.sampling_params import MAX_LOGPROBS, SamplingParams, cache_control_error, stop_string_error

_MAX_INT32 = 2**31 - 1  # bound for token ids and token counts; the server checks the real limits
_MAX_N = 128
_MAX_STOP = 64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_NEUTRAL_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}

TokenId = Annotated[int, Field(ge=0, le=_MAX_INT32)]


def _invalid(message: str) -> PydanticCustomError:
    """A validation error whose message is exactly `message` (no "Value error, " prefix)."""
    return PydanticCustomError("value_error", "{message}", {"message": message})


def _fail_at(field: str, value: Any, message: str) -> ValidationError:
    """A validation error located at `field`, for checks that look at several fields at once."""
    details = InitErrorDetails(type=_invalid(message), loc=(field,), input=value)
    return ValidationError.from_exception_data("request", [details])


_JSON_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object", type(None): "null"}


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words ("an array"), for error messages."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_INT32


def _check_token_ids(ids: list[Any], where: str) -> None:
    if not ids:
        raise _invalid(f"{where} must not be an empty list of token ids")
    for i, t in enumerate(ids):
        if not _is_token_id(t):
            raise _invalid(f"{where}[{i}]={t!r}: token ids must be ints in [0, {_MAX_INT32}]")


def _must_be_empty(cls: type, value: Any, info: ValidationInfo) -> Any:
    """A validator for fields not supported yet that are neutral when empty (logit_bias, suffix, tools)."""
    if value:
        raise _invalid(f"{info.field_name} is not supported yet; send null or leave it empty")
    return value


# ---------------------------------------------------------------- requests


class _RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_RequestModel):
    """What a streamed response reports besides the text."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_RequestModel):
    """The fields completions and chat completions share, with their checks and their mapping."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=_MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extra sampling fields
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1, le=_MAX_INT32)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=_MAX_INT32)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=_MAX_STOP)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's P/D field: handed to the engine's KV connector as SamplingParams.extra_args["kv_transfer_params"]
    kv_transfer_params: dict[str, Any] | None = None
    # the offload tier's admission hint, {"type": "ephemeral"} (as Anthropic's prompt caching and Dynamo's
    # agent hints): keep this conversation's prefix; SamplingParams.extra_args["cache_control"]
    cache_control: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value == "":
            raise _invalid("stop must not be an empty string; send null for no stop strings")
        if value is None:
            return value
        if isinstance(value, str):
            named = [("stop", value)]
        elif not isinstance(value, list):
            raise _invalid(f"stop must be a string, a list of strings or null, not {_kind(value)}")
        elif len(value) > _MAX_STOP:
            raise _invalid(f"stop has {len(value)} strings; at most {_MAX_STOP} are allowed")
        else:
            named = [(f"stop[{i}]", s) for i, s in enumerate(value)]
        for where, s in named:
            # empty, longer than MAX_STOP_STRING_CHARS, or not valid Unicode (a lone surrogate)
            message = stop_string_error(where, s)
            if message is not None:
                raise _invalid(message)
        return value

    @field_validator(*_NEUTRAL_PENALTIES, mode="after")
    @classmethod
    def _no_penalties(cls, value: float, info: ValidationInfo) -> float:
        neutral = _NEUTRAL_PENALTIES[info.field_name]
        if value != neutral:
            raise _invalid(f"{info.field_name} is not supported yet; leave it at {neutral:g} (got {value!r})")
        return value

    _no_logit_bias = field_validator("logit_bias", mode="after")(_must_be_empty)

    @field_validator("kv_transfer_params", mode="before")
    @classmethod
    def _check_kv_transfer_params(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise _invalid(f"kv_transfer_params must be an object or null, not {_kind(value)}")
        return value

    @field_validator("cache_control", mode="before")
    @classmethod
    def _check_cache_control(cls, value: Any) -> Any:
        message = cache_control_error("cache_control", value)
        if message is not None:
            raise _invalid(message)
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's cap on generated tokens; None means up to the context length."""
        raise NotImplementedError

    @model_validator(mode="after")
    def _check_cross_fields(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            message = "stream_options is only allowed when stream is true"
            raise _fail_at("stream_options", self.stream_options.model_dump(), message)
        cap = self.requested_max_tokens
        if cap is not None and self.min_tokens > cap:
            message = f"min_tokens={self.min_tokens} must be <= the requested max tokens ({cap})"
            raise _fail_at("min_tokens", self.min_tokens, message)
        return self

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=1,  # the server fans a request with n > 1 out into n engine requests
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            extra_args={name: value for name, value in (("kv_transfer_params", self.kv_transfer_params),
                                                        ("cache_control", self.cache_control))
                        if value is not None} or None,
        )


def _check_logprobs_limit(field: str, value: int | None, max_logprobs: int) -> None:
    if value is not None and value > max_logprobs:
        raise ValueError(f"{field}={value} is more than this server allows; ask for at most {max_logprobs}")


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions.

    prompt: one string, several strings, one tokenized prompt (a list of ints) or several (a list of lists).
    max_tokens: 16 by default; None means up to the context length; 0 only with echo (the prompt alone,
        as lm-eval's loglikelihood requests ask).
    logprobs: top logprobs per generated token (0..20); the server also checks its own max_logprobs.
        With echo, the prompt's tokens come first in the choice's logprobs, with their prompt logprobs
        (None for the first token).
    prompt_logprobs (vLLM's): top logprobs per prompt token, returned in each choice's
        `prompt_logprobs` (not when streaming, as in vLLM); with echo it defaults to `logprobs`.
    best_of: only unset or equal to n; suffix: only unset or empty.
    return_token_ids (vLLM's): each choice also carries its generated `token_ids` (when streaming, the
    new ids of each chunk, and a chunk for every new id even where the text is still empty) and its
    `prompt_token_ids` (when streaming, in the choice's first chunk only).
    """

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=0, le=_MAX_INT32)
    best_of: int | None = Field(default=None, ge=1, le=_MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise _invalid("prompt must not be an empty string")
            return value
        if not isinstance(value, list):
            shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
            raise _invalid(f"prompt must be {shapes}, not {_kind(value)}")
        if not value:
            raise _invalid("prompt must not be an empty list")
        if all(isinstance(p, str) for p in value):
            for i, p in enumerate(value):
                if not p:
                    raise _invalid(f"prompt[{i}] must not be an empty string")
        elif all(isinstance(p, list) for p in value):
            for i, p in enumerate(value):
                _check_token_ids(p, f"prompt[{i}]")
        elif all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            _check_token_ids(value, "prompt")
        else:
            kinds = " and ".join(sorted({_kind(p) for p in value}))
            raise _invalid(f"prompt is a list mixing {kinds}; send strings, token ids or token-id lists, not a mix")
        return value

    _no_suffix = field_validator("suffix", mode="after")(_must_be_empty)

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            message = f"best_of={self.best_of} is not supported yet; leave it unset or equal to n={self.n}"
            raise _fail_at("best_of", self.best_of, message)
        if self.max_tokens == 0 and not self.echo:
            message = ("max_tokens: 0 asks for no completion, which only echo=true makes useful (the prompt "
                       "and its logprobs alone); ask for at least 1 token, or set echo")
            raise _fail_at("max_tokens", 0, message)
        if self.prompt_logprobs and self.stream:  # as vLLM: prompt logprobs are not sent in streams
            message = ("prompt_logprobs: not available when stream is true (as in vLLM); send stream=false, or "
                       "use echo with logprobs, which streams the prompt's logprobs in the first chunk")
            raise _fail_at("prompt_logprobs", self.prompt_logprobs, message)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's cap on generated tokens; None means up to the context length."""
        return self.max_tokens

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the answer is the prompt alone. The engine still generates one token
        (it cannot generate none), which the server drops."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts: strings, or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(self, max_tokens: int | None, max_logprobs: int) -> SamplingParams:
        """The engine's SamplingParams for one of this request's n completions.

        max_tokens: as the server resolved it (the request's max_tokens, or what fits the context).
        max_logprobs: the server's limit; a larger `logprobs` or `prompt_logprobs` raises ValueError
        naming it. echo with logprobs asks for prompt logprobs too, `logprobs` of them unless
        `prompt_logprobs` says otherwise (as vLLM).
        """
        _check_logprobs_limit("logprobs", self.logprobs, max_logprobs)
        _check_logprobs_limit("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class TextContentPart(_RequestModel):
    """One text part of a message's content; the only part type served so far."""

    type: Literal["text"]
    text: str


class ChatMessageParam(_RequestModel):
    """One message of a chat request. content may be null only for the assistant."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _invalid(f"content must be a string, a list of content parts or null, not {_kind(value)}")
        if not value:
            raise _invalid("content must not be an empty list")
        for i, part in enumerate(value):
            if isinstance(part, TextContentPart):
                continue
            if not isinstance(part, dict):
                raise _invalid(f"content[{i}] must be an object with a type, not {_kind(part)}")
            if part.get("type") != "text":
                kind = part.get("type")
                raise _invalid(f"content[{i}] has type {kind!r}, which is not supported yet; only 'text' parts are")
            if set(part) - {"type", "text"}:
                raise _invalid(f"content[{i}]: unrecognized field {sorted(set(part) - {'type', 'text'})[0]!r}")
            if not isinstance(part.get("text"), str):
                raise _invalid(f"content[{i}].text must be a string, not {_kind(part.get('text'))}")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessageParam:
        if self.content is None and self.role != "assistant":
            raise _fail_at("content", None, f"content is required for role {self.role!r}")
        return self

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines; None when there is none."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponseFormat(_RequestModel):
    """The output format; only plain text is served so far."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions.

    max_completion_tokens: the cap on generated tokens; max_tokens is its deprecated alias (they must agree).
    logprobs: return the sampled tokens' logprobs; top_logprobs (0..20, needs logprobs) adds alternatives.
    tools, tool_choice, response_format: accepted only at values that need no tool calling or
    constrained decoding (no tools, tool_choice none/auto, response_format text).
    prompt_token_ids (deltaserve's): the prompt as token ids, used instead of rendering `messages`
        (which are still validated, and must still hold a message), so a P/D decode leg runs exactly the
        prompt its prefill leg ran; the chat template fields are then not used.
    return_token_ids (vLLM's): each choice also carries its generated `token_ids` (when streaming, the
        new ids of each chunk) and its `prompt_token_ids` (when streaming, in the choice's first chunk).
    """

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=_MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra chat fields
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless the server runs with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False
    prompt_token_ids: list[TokenId] | None = None

    _no_tools = field_validator("tools", mode="after")(_must_be_empty)

    @field_validator("prompt_token_ids", mode="after")
    @classmethod
    def _check_prompt_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise _invalid("prompt_token_ids must not be an empty list; send null to render messages instead")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto"):
            return value
        if value == "required" or isinstance(value, dict):
            raise _invalid("tool_choice is not supported yet (no tools can be called); send 'none', 'auto' or null")
        raise _invalid(f"tool_choice={value!r} must be 'none', 'auto', 'required', an object or null")

    @field_validator("response_format", mode="after")
    @classmethod
    def _text_only(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None and value.type != "text":
            raise _invalid(f"response_format type {value.type!r} is not supported yet; only 'text' is")
        return value

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        given, alias = self.max_completion_tokens, self.max_tokens
        if given is not None and alias is not None and given != alias:
            message = (f"max_completion_tokens={given} disagrees with max_tokens={alias}; "
                       "max_tokens is a deprecated alias, send only max_completion_tokens")
            raise _fail_at("max_completion_tokens", given, message)
        if self.top_logprobs is not None and not self.logprobs:
            raise _fail_at("top_logprobs", self.top_logprobs, "top_logprobs is only allowed when logprobs is true")
        if self.continue_final_message and self.add_generation_prompt:
            message = ("continue_final_message and add_generation_prompt cannot both be true; "
                       "set add_generation_prompt to false to continue the final message")
            raise _fail_at("continue_final_message", True, message)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens; None means up to the context length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None, max_logprobs: int) -> SamplingParams:
        """The engine's SamplingParams for one of this request's n completions.

        max_tokens: as the server resolved it (requested_max_tokens, or what fits the context).
        max_logprobs: the server's limit; a larger `top_logprobs` raises ValueError naming it.
        """
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        _check_logprobs_limit("top_logprobs", logprobs, max_logprobs)
        return self._sampling_params(max_tokens, logprobs)


# ---------------------------------------------------------------- validation errors

_ERROR_LIMIT = 60  # characters of a rejected value quoted back


def _quote(value: Any) -> str | None:
    """A short repr of a scalar input, or None for containers (too long to echo back)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= _ERROR_LIMIT else text[: _ERROR_LIMIT - 3] + "..."
    return None


def _starts_with_param(message: str, param: str) -> bool:
    rest = message[len(param):]
    return message.startswith(param) and (not rest or not (rest[0].isalnum() or rest[0] == "_"))


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """OpenAI's (message, param) for a list of pydantic error dicts.

    Takes `ValidationError.errors()` or FastAPI's `RequestValidationError.errors()` (whose loc starts with
    "body"). param is the dotted location of the first error ("max_tokens", "messages.0.content"), or None
    when the error is about the body as a whole; the message names the field, says what is wrong and
    quotes the value when it is short.
    """
    if not errors:
        return "Invalid request body", None
    first = errors[0]
    loc = list(first.get("loc") or ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = first.get("type", "")
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    param = ".".join(str(part) for part in loc) or None

    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or msg
        return f"The request body is not valid JSON: {detail}", None
    if param is None:
        message = "The request body is missing" if kind == "missing" else f"Invalid request body: {msg}"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"{param}: this field is required"
    else:
        message = msg if _starts_with_param(msg, param) else f"{param}: {msg}"
        quoted = _quote(first.get("input"))
        if kind != "value_error" and quoted is not None:
            message += f" (got {quoted})"
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return message, param


def format_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """OpenAI's (message, param) for a pydantic ValidationError; see format_validation_errors."""
    return format_validation_errors(exc.errors(include_url=False))


# ---------------------------------------------------------------- responses


def now_s() -> int:
    """Unix time in whole seconds, for `created`."""
    return int(time.time())


class ErrorInfo(BaseModel):
    """The inside of OpenAI's error body."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    """How many prompt tokens came from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a request (or, when streaming, of the chunks so far)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob of one token at one prompt position: its logprob, rank (1 = most likely), text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseStreamChoice(BaseModel):
    """One completion, or one streamed chunk of it; stop_reason is the stop string or token id that
    ended it, if any. token_ids and prompt_token_ids are set only for a request with return_token_ids."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponseChoice(CompletionResponseStreamChoice):
    """One non-streamed completion; prompt_logprobs (vLLM's) is set for a request with prompt logprobs:
    None for the first prompt token, then {token id: PromptLogprob}."""

    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """Body of a non-streamed /v1/completions answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a P/D producer's, for its consumer


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed /v1/completions answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # on the last chunk (chunked transfer: the first); sent when set


class ChatCompletionTopLogprob(BaseModel):
    """One alternative token at a position, with its logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(ChatCompletionTopLogprob):
    """The sampled token at a position, with the most likely alternatives."""

    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatCompletionTokenLogprob] | None = None


class ChatMessage(BaseModel):
    """The assistant's message of a non-streamed chat answer."""

    role: str
    content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    """One chat completion; stop_reason is the stop string or token id that ended it, if any.
    token_ids and prompt_token_ids are set only for a request with return_token_ids."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed /v1/chat/completions answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a P/D producer's, for its consumer


class DeltaMessage(BaseModel):
    """What a streamed chunk adds to the assistant's message."""

    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    """One choice of a streamed chat chunk; with return_token_ids, its new token_ids, and the
    prompt_token_ids in the choice's first chunk (sent only for such a request)."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed /v1/chat/completions answer."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # on the last chunk (chunked transfer: the first); sent when set


class ModelCard(BaseModel):
    """One entry of /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "deltaserve"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None  # deltaserve's own: the token-id range [0, vocab_size) prompts may use
    # deltaserve's own: tokens of context the KV cache holds over all requests (x the DCP group's size)
    kv_cache_capacity_tokens: int | None = None


class ModelList(BaseModel):
    """Body of /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
