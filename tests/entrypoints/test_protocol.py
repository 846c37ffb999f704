"""OpenAI request models: strict, closed, bounded; every bad value fails naming its field; mapping to SamplingParams."""

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from deltaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    format_validation_error,
    format_validation_errors,
)
from deltaserve.sampling_params import MAX_STOP_STRING_CHARS, SamplingParams

USER = [{"role": "user", "content": "hi"}]


def _error(cls: type[BaseModel], **body: Any) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return format_validation_error(info.value)


def _completion_error(**body: Any) -> tuple[str, str | None]:
    return _error(CompletionRequest, **{"prompt": "hi", **body})


def _chat_error(**body: Any) -> tuple[str, str | None]:
    return _error(ChatCompletionRequest, **{"messages": USER, **body})


# ---------------------------------------------------------------- valid requests


def test_minimal_completion_request_defaults():
    r = CompletionRequest.model_validate({"prompt": "hi"})
    assert (r.model, r.max_tokens, r.temperature, r.top_p, r.n, r.stream) == (None, 16, None, None, 1, False)
    assert (r.logprobs, r.echo, r.stop, r.seed, r.best_of, r.top_k) == (None, False, None, None, None, None)
    assert r.requested_max_tokens == 16


def test_minimal_chat_request_defaults():
    r = ChatCompletionRequest.model_validate({"messages": USER, "model": "kimi"})
    assert r.messages[0].role == "user" and r.messages[0].text() == "hi"
    assert (r.max_tokens, r.max_completion_tokens, r.requested_max_tokens) == (None, None, None)
    assert (r.logprobs, r.top_logprobs, r.add_generation_prompt, r.continue_final_message) == (False, None, True, False)


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),  # a list of ints is one tokenized prompt
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_each_prompt_shape(prompt, prompts):
    r = CompletionRequest.model_validate({"prompt": prompt})
    assert r.prompt == prompt and r.prompts == prompts


@pytest.mark.parametrize(
    "prompt, param_text",
    [
        ("", "prompt must not be an empty string"),
        ([], "prompt must not be an empty list"),
        ([""], "prompt[0] must not be an empty string"),
        ([[]], "prompt[0] must not be an empty list"),
        ([1, -2], "prompt[1]=-2"),
        ([[1], [True]], "prompt[1][0]=True"),
        ([1, "a"], "mixing"),
        (5, "prompt must be a string"),
    ],
)
def test_bad_prompts(prompt, param_text):
    message, param = _completion_error(prompt=prompt)
    assert param == "prompt" and param_text in message


def test_missing_prompt_names_it():
    message, param = _error(CompletionRequest)
    assert param == "prompt" and message == "prompt: this field is required"


def test_text_content_parts_accepted():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts, "name": "x"}]})
    assert r.messages[0].text() == "a\nb" and r.messages[0].name == "x"


def test_every_role_and_assistant_without_content():
    roles = ["system", "developer", "user", "assistant", "tool"]
    messages = [{"role": role, "content": "x"} for role in roles] + [{"role": "assistant", "content": None}]
    r = ChatCompletionRequest.model_validate({"messages": messages})
    assert [m.role for m in r.messages] == roles + ["assistant"]


# ---------------------------------------------------------------- strictness and bounds


def test_string_for_int_is_rejected():
    message, param = _completion_error(max_tokens="10")
    assert param == "max_tokens"
    assert message == "max_tokens: Input should be a valid integer (got '10')"


def test_int_accepted_for_float_fields():
    r = CompletionRequest.model_validate({"prompt": "hi", "temperature": 1, "top_p": 1, "min_p": 0})
    assert r.temperature == 1.0 and isinstance(r.temperature, float) and r.top_p == 1.0


def test_bool_is_not_an_int_and_string_is_not_a_bool():
    assert _completion_error(n=True)[1] == "n"
    assert _chat_error(logprobs="true")[1] == "logprobs"


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_unknown_field_rejected(cls):
    body = {"prompt": "hi"} if cls is CompletionRequest else {"messages": USER}
    message, param = _error(cls, **body, foo=1)
    assert (message, param) == ("Unrecognized request argument supplied: foo", "foo")


def test_unknown_nested_field_rejected():
    message, param = _chat_error(messages=[{"role": "user", "content": "x", "tool_calls": []}])
    assert param == "messages.0.tool_calls" and message.startswith("Unrecognized request argument supplied")


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("max_tokens", 2**40),
        ("temperature", 5),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("n", 0),
        ("n", 10**9),
        ("top_p", 0),
        ("top_p", 1.5),
        ("logprobs", 99),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("top_k", -5),
        ("seed", 2**70),
        ("seed", -(2**70)),
        ("min_p", 2),
        ("min_tokens", -1),
        ("presence_penalty", 3),
        ("repetition_penalty", 0),
        ("best_of", 0),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    message, param = _completion_error(**{field: value})
    assert param == field and message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    "field, value",
    [("max_completion_tokens", 0), ("max_tokens", -5), ("top_logprobs", 21), ("temperature", 2.5)],
)
def test_chat_out_of_range_values_name_the_field(field, value):
    message, param = _chat_error(logprobs=True, **{field: value})
    assert param == field and message.startswith(f"{field}: ")


def test_message_quotes_the_value():
    message, _ = _completion_error(max_tokens=-5)
    assert message == "max_tokens: Input should be greater than or equal to 0 (got -5)"


def test_stop_and_stop_token_ids():
    r = CompletionRequest.model_validate({"prompt": "x", "stop": ["a", "bc"], "stop_token_ids": [0, 7]})
    assert r.stop == ["a", "bc"] and r.stop_token_ids == [0, 7]
    assert _completion_error(stop="")[1] == "stop"
    assert "stop[1]" in _completion_error(stop=["a", ""])[0]
    assert _completion_error(stop=["a"] * 65)[1] == "stop"
    assert _completion_error(stop_token_ids=[1, -1])[1] == "stop_token_ids.1"


@pytest.mark.parametrize("error", [_completion_error, _chat_error])
@pytest.mark.parametrize(
    "stop, where",
    [("ok\ud800", "stop"), (["ok", "a\udfffb"], "stop[1]"), (["\ud83d"], "stop[0]")],
)
def test_stop_string_with_a_lone_surrogate_is_refused(error, stop, where):
    message, param = error(stop=stop)
    assert param == "stop"
    assert message.startswith(f"{where}: the text is not valid Unicode (a lone surrogate")
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["\U0001f389"]}).stop == ["\U0001f389"]


@pytest.mark.parametrize("error", [_completion_error, _chat_error])
def test_stop_string_length_is_capped(error):
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "x" * MAX_STOP_STRING_CHARS}).stop
    message, param = error(stop=["a", "x" * (MAX_STOP_STRING_CHARS + 1)])
    assert param == "stop"
    assert message == (
        f"stop[1] is {MAX_STOP_STRING_CHARS + 1} characters long; "
        f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters"
    )
    assert error(stop="x" * (MAX_STOP_STRING_CHARS + 1))[0].startswith("stop is ")


@pytest.mark.parametrize("stop", ["ok\ud800", "x" * (MAX_STOP_STRING_CHARS + 1), ""])
def test_sampling_params_refuse_the_same_stop_strings(stop):
    """The offline API refuses what the server refuses, with the same message."""
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=["fine", stop])
    assert str(info.value) == _completion_error(stop=["fine", stop])[0]


def test_min_tokens_above_max_tokens_rejected():
    message, param = _completion_error(min_tokens=20, max_tokens=10)
    assert param == "min_tokens" and "20" in message
    assert _chat_error(min_tokens=5, max_completion_tokens=4)[1] == "min_tokens"


# ---------------------------------------------------------------- cross-field rules


def test_empty_messages_rejected():
    message, param = _error(ChatCompletionRequest, messages=[])
    assert param == "messages" and message.startswith("messages: ")


def test_image_content_part_rejected():
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    message, param = _chat_error(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, image]}])
    assert param == "messages.0.content"
    assert "content[1]" in message and "'image_url'" in message and "not supported" in message


@pytest.mark.parametrize(
    "content, text",
    [
        ([], "empty list"),
        ([{"type": "text"}], "content[0].text"),
        ([{"type": "text", "text": "a", "cache": 1}], "'cache'"),
        (["a"], "content[0] must be an object"),
        (5, "not an integer"),
    ],
)
def test_bad_content(content, text):
    message, param = _chat_error(messages=[{"role": "user", "content": content}])
    assert param == "messages.0.content" and text in message


def test_content_required_except_for_assistant():
    message, param = _chat_error(messages=[{"role": "user"}])
    assert param == "messages.0.content" and "required for role 'user'" in message


def test_bad_role_names_the_message():
    message, param = _chat_error(messages=[{"role": "robot", "content": "x"}])
    assert param == "messages.0.role" and "(got 'robot')" in message


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_stream_options_need_stream(cls):
    body = {"prompt": "hi"} if cls is CompletionRequest else {"messages": USER}
    opts = {"include_usage": True}
    message, param = _error(cls, **body, stream_options=opts)
    assert param == "stream_options" and "stream" in message
    r = cls.model_validate({**body, "stream": True, "stream_options": opts})
    assert r.stream_options.include_usage and not r.stream_options.continuous_usage_stats


def test_top_logprobs_needs_logprobs():
    message, param = _chat_error(top_logprobs=3)
    assert param == "top_logprobs" and "logprobs" in message


def test_max_tokens_alias_must_agree():
    r = ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": 7, "max_completion_tokens": 7})
    assert r.requested_max_tokens == 7
    assert ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": 9}).requested_max_tokens == 9
    message, param = _chat_error(max_tokens=5, max_completion_tokens=6)
    assert param == "max_completion_tokens" and "max_tokens=5" in message


def test_continue_final_message_excludes_generation_prompt():
    assert _chat_error(continue_final_message=True)[1] == "continue_final_message"
    r = ChatCompletionRequest.model_validate(
        {"messages": USER, "continue_final_message": True, "add_generation_prompt": False}
    )
    assert r.continue_final_message


@pytest.mark.parametrize(
    "field, value",
    [("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("repetition_penalty", 1.1)],
)
@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_non_default_penalties_not_supported_yet(cls, field, value):
    body = {"prompt": "hi"} if cls is CompletionRequest else {"messages": USER}
    message, param = _error(cls, **body, **{field: value})
    assert param == field and message.startswith(f"{field} is not supported yet")


def test_neutral_values_of_unsupported_fields_accepted():
    CompletionRequest.model_validate(
        {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
         "logit_bias": {}, "suffix": "", "best_of": 2, "n": 2, "user": "me"}
    )
    ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
         "response_format": {"type": "text"}, "chat_template_kwargs": {"thinking": False}}
    )


@pytest.mark.parametrize(
    "body, field",
    [
        ({"logit_bias": {"42": 5.0}}, "logit_bias"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_completion_unsupported_fields(body, field):
    message, param = _completion_error(**body)
    assert param == field and "not supported yet" in message


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"1": 1}}, "logit_bias"),
    ],
)
def test_chat_unsupported_fields(body, field):
    message, param = _chat_error(**body)
    assert param == field and "not supported yet" in message


# ---------------------------------------------------------------- to_sampling_params


def test_completion_to_sampling_params_defaults():
    p = CompletionRequest.model_validate({"prompt": "hi", "n": 3}).to_sampling_params(16, max_logprobs=20)
    assert isinstance(p, SamplingParams)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.logprobs, p.stop, p.stop_token_ids) == (16, None, [], [])


def test_completion_to_sampling_params_maps_every_field():
    r = CompletionRequest.model_validate(
        {"prompt": [1, 2], "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -3,
         "logprobs": 5, "stop": "###", "stop_token_ids": [7], "ignore_eos": True, "min_tokens": 2,
         "skip_special_tokens": False, "spaces_between_special_tokens": False,
         "include_stop_str_in_output": True}
    )
    p = r.to_sampling_params(max_tokens=None, max_logprobs=20)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.greedy) == (0.0, 0.9, 40, 0.05, -3, True)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.ignore_eos) == (None, 2, 5, True)
    assert p.stop == ["###"] and p.stop_token_ids == [7]
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens and p.include_stop_str_in_output


def test_top_k_off_values_pass_through():
    for top_k in (-1, 0):
        r = CompletionRequest.model_validate({"prompt": "x", "top_k": top_k})
        assert r.to_sampling_params(4, max_logprobs=20).top_k == top_k


@pytest.mark.parametrize(
    "body, logprobs",
    [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4), ({"logprobs": False}, None)],
)
def test_chat_logprobs_mapping(body, logprobs):
    r = ChatCompletionRequest.model_validate({"messages": USER, "max_completion_tokens": 8, **body})
    p = r.to_sampling_params(r.requested_max_tokens, max_logprobs=20)
    assert p.logprobs == logprobs and p.max_tokens == 8 and p.n == 1


def test_logprobs_above_server_limit_raise_naming_the_field():
    with pytest.raises(ValueError, match=r"^logprobs=5 .*at most 2"):
        CompletionRequest.model_validate({"prompt": "x", "logprobs": 5}).to_sampling_params(16, max_logprobs=2)
    r = ChatCompletionRequest.model_validate({"messages": USER, "logprobs": True, "top_logprobs": 5})
    with pytest.raises(ValueError, match=r"^top_logprobs=5 "):
        r.to_sampling_params(16, max_logprobs=2)
    with pytest.raises(ValueError, match=r"^prompt_logprobs=5 .*at most 2"):
        CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 5}).to_sampling_params(16, max_logprobs=2)


@pytest.mark.parametrize(
    "body, prompt_logprobs",
    [({}, None), ({"echo": True}, None), ({"logprobs": 3}, None), ({"echo": True, "logprobs": 3}, 3),
     ({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 1), ({"prompt_logprobs": 0}, 0)],
)
def test_echo_with_logprobs_asks_for_prompt_logprobs(body, prompt_logprobs):
    """As vLLM: echo with logprobs needs the prompt's logprobs, `logprobs` of them by default."""
    p = CompletionRequest.model_validate({"prompt": "x", **body}).to_sampling_params(16, max_logprobs=20)
    assert p.prompt_logprobs == prompt_logprobs


def test_max_tokens_zero_only_with_echo():
    r = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.echo_only and r.requested_max_tokens == 0
    assert not CompletionRequest.model_validate({"prompt": "x", "echo": True}).echo_only
    message, param = _completion_error(max_tokens=0)
    assert param == "max_tokens" and message.startswith("max_tokens: ") and "echo" in message


def test_prompt_logprobs_not_streamed():
    message, param = _completion_error(prompt_logprobs=2, stream=True)
    assert param == "prompt_logprobs" and message.startswith("prompt_logprobs: ") and "stream" in message
    CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 0, "stream": True})  # as vLLM: 0 is fine


# ---------------------------------------------------------------- format_validation_errors


def test_body_prefix_is_stripped():
    errors = [{"type": "int_type", "loc": ("body", "max_tokens"), "msg": "Input should be a valid integer",
               "input": "10"}]
    assert format_validation_errors(errors) == ("max_tokens: Input should be a valid integer (got '10')",
                                                "max_tokens")
    nested = [{"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required", "input": {}}]
    assert format_validation_errors(nested) == ("messages.0.role: this field is required", "messages.0.role")
    extra = [{"type": "extra_forbidden", "loc": ("body", "foo"), "msg": "Extra inputs are not permitted", "input": 1}]
    assert format_validation_errors(extra) == ("Unrecognized request argument supplied: foo", "foo")


def test_errors_about_the_whole_body():
    bad_json = [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error", "input": {},
                 "ctx": {"error": "Expecting ',' delimiter"}}]
    message, param = format_validation_errors(bad_json)
    assert param is None and "not valid JSON" in message and "Expecting ',' delimiter" in message
    assert format_validation_errors([{"type": "missing", "loc": ("body",), "msg": "Field required"}])[1] is None
    not_object = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be an object", "input": []}]
    assert format_validation_errors(not_object) == ("Invalid request body: Input should be an object", None)
    assert format_validation_errors([]) == ("Invalid request body", None)


def test_value_error_prefix_stripped_and_more_errors_counted():
    errors = [
        {"type": "value_error", "loc": ("body", "stop"), "msg": "Value error, stop must be non-empty", "input": ""},
        {"type": "int_type", "loc": ("body", "n"), "msg": "Input should be a valid integer", "input": "2"},
    ]
    assert format_validation_errors(errors) == ("stop must be non-empty (and 1 more error)", "stop")


def test_only_short_scalars_are_quoted_back():
    message, _ = _completion_error(model=["x"] * 3)
    assert message == "model: Input should be a valid string"  # containers are not quoted back
    message, _ = _completion_error(max_tokens="9" * 500)
    assert message.endswith("...)") and len(message) < 150
    assert _completion_error(user=7)[0].endswith("(got 7)")


# ---------------------------------------------------------------- responses


def test_response_bodies_serialize_like_openai():
    err = ErrorResponse(error=ErrorInfo(message="bad", type="invalid_request_error", param="n"))
    assert err.model_dump() == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                                          "code": None}}
    chat = ChatCompletionResponse(
        id="chatcmpl-1", model="kimi", usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="ok"),
                                              finish_reason="stop")],
    )
    body = chat.model_dump()
    assert body["object"] == "chat.completion" and isinstance(body["created"], int)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    models = ModelList(data=[ModelCard(id="kimi", max_model_len=4096)]).model_dump()
    assert models["object"] == "list" and models["data"][0]["owned_by"] == "deltaserve"
