"""POST /v1/chat/completions: messages through the checkpoint's chat template, n samples, streamed or not."""

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
    ServingContext,
    cancel_on_disconnect,
    collect_outputs,
    make_usage,
    new_id,
    plan_sub_requests,
    sse,
    sse_response,
    stream_deltas,
)
from deltaserve.outputs import Logprob, RequestOutput


def render_chat(tokenizer: Any, body: ChatCompletionRequest) -> str:
    """The prompt text the chat template makes of the messages; template failures are a 400."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
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
            **(body.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, template-raised errors, bad kwargs: the request's fault
        raise OpenAIError(f"messages: the chat template failed: {e}", 400, param="messages") from e


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
        prompt = render_chat(self.ctx.engine.tokenizer, body)
        request_id = new_id("chatcmpl")
        planned = await plan_sub_requests(self.ctx, request_id, [prompt], params, body.n, body.requested_max_tokens,
                                    time.time(), prompt_param="messages")
        top_k = (body.top_logprobs or 0) if body.logprobs else -1
        if body.stream:
            return sse_response(self._stream(request_id, model, planned, body.n, top_k, body.include_usage))

        async def work() -> ChatCompletionResponse:
            finals = await collect_outputs(self.ctx, planned)
            return self._response(request_id, model, finals, body.n, top_k)

        response = await cancel_on_disconnect(raw_request, work)
        return JSONResponse(response.model_dump())

    def _response(self, request_id: str, model: str, finals: dict[int, RequestOutput], n: int, top_k: int,
                  ) -> ChatCompletionResponse:
        choices = []
        for choice in sorted(finals):
            completion = finals[choice].outputs[0]
            logprobs = None
            if top_k >= 0:
                logprobs = chat_logprobs(completion.logprobs or [], completion.token_ids, top_k)
            choices.append(ChatCompletionResponseChoice(
                index=choice, message=ChatMessage(role="assistant", content=completion.text), logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            ))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=make_usage(finals, n))

    async def _stream(self, request_id: str, model: str, planned: list, n: int, top_k: int,
                      include_usage: bool) -> AsyncGenerator[str, None]:
        created = now_s()
        finals: dict[int, RequestOutput] = {}

        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    usage=usage))

        for choice, _, _ in planned:  # the role comes first, as in OpenAI's streams
            yield chunk([ChatCompletionResponseStreamChoice(
                index=choice, delta=DeltaMessage(role="assistant", content=""))])
        async for d in stream_deltas(self.ctx, planned, finals):
            completion = d.output.outputs[0]
            logprobs = None
            if top_k >= 0 and d.logprobs is not None:
                logprobs = chat_logprobs(d.logprobs, d.token_ids, top_k)
            if not d.text and not d.output.finished and logprobs is None:
                continue
            yield chunk([ChatCompletionResponseStreamChoice(
                index=d.choice, delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            )])
        if include_usage:
            yield chunk([], make_usage(finals, n))
