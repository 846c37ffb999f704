"""POST /v1/chat/completions: messages through the checkpoint's chat template, n samples, streamed or not.

A request with `prompt_token_ids` (a P/D decode leg) runs those ids as its prompt and renders nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from deltaserve.entrypoints.openai.errors import OpenAIError
from deltaserve.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatCompletionTopLogprob,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    now_s,
)
from deltaserve.entrypoints.openai.serving_common import (
    INLINE_WORK_CHARS,
    ServingContext,
    cancel_on_disconnect,
    collect_outputs,
    kv_transfer_params,
    make_usage,
    new_id,
    plan_sub_requests,
    sse,
    sse_response,
    stream_deltas,
)
from deltaserve.outputs import Logprob, RequestOutput

# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def template_arguments(body: ChatCompletionRequest, trust_request_template: bool) -> dict[str, Any]:
    """apply_chat_template's keyword arguments for this request. A template of the request's own
    (`chat_template`, or `chat_template_kwargs.chat_template`) is a 400 unless the operator trusts them."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    if body.chat_template is not None:
        if template is not None:
            raise OpenAIError("send the chat template once: chat_template or chat_template_kwargs.chat_template",
                              400, param="chat_template")
        template = body.chat_template
    if template is not None and not trust_request_template:
        raise OpenAIError(
            "chat_template: this server does not accept chat templates in requests (the operator can allow them "
            "with --trust-request-chat-template)", 400, param="chat_template",
        )
    if template is not None and not isinstance(template, str):
        raise OpenAIError("chat_template must be a string", 400, param="chat_template")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise OpenAIError(f"chat_template_kwargs.{reserved[0]} is not allowed: the server sets it",
                          400, param="chat_template_kwargs")
    if template is not None:
        kwargs["chat_template"] = template
    return kwargs


def render_chat(tokenizer: Any, body: ChatCompletionRequest, template_kwargs: dict[str, Any]) -> str:
    """The prompt text the chat template makes of the messages; template failures are a 400."""
    if tokenizer is None or not (getattr(tokenizer, "chat_template", None) or "chat_template" in template_kwargs):
        raise OpenAIError("this model has no chat template; use /v1/completions", 400, param="messages")
    conversation = []
    for message in body.messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text() or ""}
        if message.name:
            entry["name"] = message.name
        conversation.append(entry)
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **template_kwargs,
        )
    except Exception as e:  # jinja errors, template-raised errors, bad kwargs: the request's fault
        raise OpenAIError(f"messages: the chat template failed: {e}", 400, param="messages") from e


def _content_chars(body: ChatCompletionRequest) -> int:
    return sum(len(message.text() or "") for message in body.messages)


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_k: int) -> ChatCompletionLogProbs:
    """Per token: its text, logprob and bytes, and the top_k most likely tokens in rank order."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and 1 <= lp.rank <= top_k),
                     key=lambda lp: lp.rank)
        content.append(ChatCompletionTokenLogprob(
            token=sampled.decoded_token or "", logprob=sampled.logprob,
            bytes=list((sampled.decoded_token or "").encode("utf-8")),
            top_logprobs=[ChatCompletionTopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                                   bytes=list((lp.decoded_token or "").encode("utf-8")))
                          for lp in top],
        ))
    return ChatCompletionLogProbs(content=content)


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, body: ChatCompletionRequest, raw_request: Request):
        model = self.ctx.resolve_model(body.model)
        params = self.ctx.sampling_params(body)
        if body.prompt_token_ids is not None:
            prompt: str | list[int] = list(body.prompt_token_ids)
            prompt_param = "prompt_token_ids"
        else:
            prompt, prompt_param = await self._render(body), "messages"
        request_id = new_id("chatcmpl")
        planned = await plan_sub_requests(self.ctx, request_id, [prompt], params, body.n, body.requested_max_tokens,
                                          time.time(), prompt_param=prompt_param)
        top_k = (body.top_logprobs or 0) if body.logprobs else -1
        if body.stream:
            return sse_response(self._stream(request_id, model, planned, body, top_k))

        async def work() -> ChatCompletionResponse:
            finals = await collect_outputs(self.ctx, planned)
            return self._response(request_id, model, finals, body, top_k)

        response = await cancel_on_disconnect(raw_request, work)
        return JSONResponse(response.model_dump())

    async def _render(self, body: ChatCompletionRequest) -> str:
        """The prompt text; a request's own template, or long messages, render in the CPU-work pool
        under its time limit, so neither blocks the event loop."""
        kwargs = template_arguments(body, self.ctx.trust_request_chat_template)
        tokenizer = self.ctx.engine.tokenizer
        if "chat_template" not in kwargs and _content_chars(body) <= INLINE_WORK_CHARS:
            return render_chat(tokenizer, body, kwargs)
        return await self.ctx.cpu_work.run("rendering the chat template", "messages", render_chat, tokenizer, body,
                                           kwargs)

    def _response(self, request_id: str, model: str, finals: dict[int, RequestOutput], body: ChatCompletionRequest,
                  top_k: int) -> ChatCompletionResponse:
        choices = []
        with_ids = body.return_token_ids
        for choice in sorted(finals):
            completion = finals[choice].outputs[0]
            logprobs = None
            if top_k >= 0:
                logprobs = chat_logprobs(completion.logprobs or [], completion.token_ids, top_k)
            choices.append(ChatCompletionResponseChoice(
                index=choice, message=ChatMessage(role="assistant", content=completion.text), logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_token_ids=list(finals[choice].prompt_token_ids) if with_ids else None,
                token_ids=list(completion.token_ids) if with_ids else None,
            ))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=make_usage(finals, body.n),
                                      kv_transfer_params=kv_transfer_params(finals))

    async def _stream(self, request_id: str, model: str, planned: list, body: ChatCompletionRequest,
                      top_k: int) -> AsyncGenerator[str, None]:
        created = now_s()
        finals: dict[int, RequestOutput] = {}
        with_ids = body.return_token_ids

        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None,
                  last: bool = False, early: dict | None = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    usage=usage,
                                                    kv_transfer_params=kv_transfer_params(finals) if last else early),
                       token_ids=with_ids)

        for choice, _, _ in planned:  # the role comes first, as in OpenAI's streams
            yield chunk([ChatCompletionResponseStreamChoice(
                index=choice, delta=DeltaMessage(role="assistant", content=""))])
        async for d in stream_deltas(self.ctx, planned, finals):
            completion = d.output.outputs[0]
            logprobs = None
            if top_k >= 0 and d.logprobs is not None:
                logprobs = chat_logprobs(d.logprobs, d.token_ids, top_k)
            early = None if d.output.finished else d.output.kv_transfer_params  # chunked transfer's, before tokens
            if not d.text and not d.output.finished and logprobs is None and not (with_ids and d.token_ids) \
                    and early is None:
                continue
            last = len(finals) == len(planned) and d.output.finished and not body.include_usage
            yield chunk([ChatCompletionResponseStreamChoice(
                index=d.choice, delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_token_ids=list(d.output.prompt_token_ids) if with_ids and d.first else None,
                token_ids=list(d.token_ids) if with_ids else None,
            )], last=last, early=early)
        if body.include_usage:
            yield chunk([], make_usage(finals, body.n), last=True)
