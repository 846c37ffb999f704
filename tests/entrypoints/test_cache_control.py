"""The offload tier's admission hint, `cache_control: {"type": "ephemeral"}`: accepted on both endpoints
and in SamplingParams.extra_args, anything else refused naming the field. The engine side (only hinted
requests saved under --kv-offloading-admission cache_control) is tested in tests/offload/."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deltaserve.sampling_params import SamplingParams, wants_cache

HINT = {"type": "ephemeral"}
MESSAGES = [{"role": "user", "content": "hello"}]


def test_the_field_becomes_extra_args_beside_kv_transfer_params():
    completion = CompletionRequest.model_validate({"prompt": "hi", "cache_control": HINT})
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "cache_control": HINT,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
    assert completion.to_sampling_params(4, 20).extra_args == {"cache_control": HINT}
    params = chat.to_sampling_params(4, 20)
    assert params.extra_args == {"kv_transfer_params": {"do_remote_decode": True}, "cache_control": HINT}
    assert wants_cache(params) and not wants_cache(SamplingParams()) and not wants_cache(None)


@pytest.mark.parametrize("bad", [True, "ephemeral", {"type": "persistent"}, {"type": "ephemeral", "ttl": "1h"}, []])
def test_anything_else_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError, match="cache_control"):
        CompletionRequest.model_validate({"prompt": "hi", "cache_control": bad})
    with pytest.raises(ValueError, match="cache_control"):
        SamplingParams(extra_args={"cache_control": bad})
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=["cache_control"])
