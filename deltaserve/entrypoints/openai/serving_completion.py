"""POST /v1/completions: one or several prompts (text or token ids), n samples each, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse

from deltaserve.entrypoints.openai.errors import OpenAIError
from deltaserve.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
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


def completion_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], text_offset: int,
                        ) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy logprobs for these tokens: each sampled token's text and logprob, the top
    alternatives by text, and each token's character offset. Returns them and the next offset."""
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.text_offset.append(text_offset)
        result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        text_offset += len(token)
    return result, text_offset


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, body: CompletionRequest, raw_request: Request):
        model = self.ctx.resolve_model(body.model)
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs needs prompt logprobs, which are not supported yet", 400,
                              param="echo")
        params = self.ctx.sampling_params(body)
        request_id = new_id("cmpl")
        planned = await plan_sub_requests(self.ctx, request_id, body.prompts, params, body.n, body.max_tokens,
                                          time.time())
        echo_texts = {}
        if body.echo:
            tokenizer = self.ctx.engine.tokenizer
            for choice, text, core in planned:
                if text is None and tokenizer is not None:
                    text = tokenizer.decode(core.prompt_token_ids)
                echo_texts[choice] = text or ""
        if body.stream:
            return sse_response(self._stream(request_id, model, planned, body.n, echo_texts, body.include_usage,
                                             body.return_token_ids))

        async def work() -> CompletionResponse:
            finals = await collect_outputs(self.ctx, planned)
            return self._response(request_id, model, finals, body.n, echo_texts, body.logprobs is not None,
                                  body.return_token_ids)

        response = await cancel_on_disconnect(raw_request, work)
        return JSONResponse(response.model_dump())

    def _response(self, request_id: str, model: str, finals: dict[int, RequestOutput], n: int,
                  echo_texts: dict[int, str], with_logprobs: bool, with_token_ids: bool) -> CompletionResponse:
        choices = []
        for choice in sorted(finals):
            completion = finals[choice].outputs[0]
            prefix = echo_texts.get(choice, "")
            logprobs = None
            if with_logprobs:
                logprobs, _ = completion_logprobs(completion.logprobs or [], completion.token_ids, len(prefix))
            choices.append(CompletionResponseChoice(
                index=choice, text=prefix + completion.text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_token_ids=list(finals[choice].prompt_token_ids) if with_token_ids else None,
                token_ids=list(completion.token_ids) if with_token_ids else None,
            ))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=make_usage(finals, n))

    async def _stream(self, request_id: str, model: str, planned: list, n: int, echo_texts: dict[int, str],
                      include_usage: bool, with_token_ids: bool) -> AsyncGenerator[str, None]:
        created = now_s()
        offsets: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        async for d in stream_deltas(self.ctx, planned, finals):
            completion = d.output.outputs[0]
            text = d.text
            if d.first:
                text = echo_texts.get(d.choice, "") + text
                offsets[d.choice] = len(echo_texts.get(d.choice, ""))
            logprobs = None
            if d.logprobs is not None:
                logprobs, offsets[d.choice] = completion_logprobs(d.logprobs, d.token_ids, offsets[d.choice])
            new_ids = with_token_ids and bool(d.token_ids)
            if not text and not d.output.finished and logprobs is None and not new_ids:
                continue
            choice = CompletionResponseChoice(
                index=d.choice, text=text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_token_ids=list(d.output.prompt_token_ids) if with_token_ids and d.first else None,
                token_ids=list(d.token_ids) if with_token_ids else None,
            )
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))
        if include_usage:
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                               usage=make_usage(finals, n)))
