"""POST /v1/completions: one or several prompts (text or token ids), n samples each, streamed or not.

With echo the prompt comes before the completion; with echo and logprobs the prompt's tokens and
their prompt logprobs (None for the first token) come first in the choice's logprobs too, and
max_tokens=0 returns the prompt alone: what lm-eval's loglikelihood requests send, answered as vLLM
answers them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from deltaserve.engine.detokenizer import decode_logprobs
from deltaserve.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    PromptLogprob,
    now_s,
)
from deltaserve.entrypoints.openai.serving_common import (
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

LOGPROB_FLOOR = -9999.0  # what OpenAI (and vLLM) send for a logprob of -inf, which JSON cannot carry


def completion_logprobs(entries: Sequence[dict[int, Logprob] | None], token_ids: Sequence[int], text_offset: int,
                        tokenizer: Any | None = None) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy logprobs for these tokens: each token's text and logprob, the top
    alternatives by text, and each token's character offset. Returns them and the next offset.

    An entry of None (the first prompt token of an echo, which has no logprob) gives null
    token_logprobs and top_logprobs, and its text from `tokenizer`. Logprobs are floored at -9999.
    """
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            token = decode_logprobs(tokenizer, [token_id])[0] if tokenizer is not None else ""
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            sampled = entry[token_id]
            token = sampled.decoded_token or ""
            result.token_logprobs.append(max(sampled.logprob, LOGPROB_FLOOR))
            result.top_logprobs.append({(lp.decoded_token or ""): max(lp.logprob, LOGPROB_FLOOR)
                                        for lp in entry.values()})
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


def with_prompt(output: RequestOutput, token_ids: list[int], entries: list[dict[int, Logprob]],
                ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """The prompt's tokens and prompt logprobs before these completion tokens and entries (echo)."""
    prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return [*output.prompt_token_ids, *token_ids], [*prompt_entries, *entries]


def prompt_logprobs_field(output: RequestOutput) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's choice.prompt_logprobs: the request's prompt logprobs, floored at -9999."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {tid: PromptLogprob(logprob=max(lp.logprob, LOGPROB_FLOOR), rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in entry.items()}
            for entry in output.prompt_logprobs]


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, body: CompletionRequest, raw_request: Request):
        model = self.ctx.resolve_model(body.model)
        params = self.ctx.sampling_params(body)
        request_id = new_id("cmpl")
        max_tokens = 1 if body.echo_only else body.max_tokens  # the one token of an echo_only is dropped
        planned = await plan_sub_requests(self.ctx, request_id, body.prompts, params, body.n, max_tokens,
                                          time.time())
        echo_texts = {}
        if body.echo:
            tokenizer = self.ctx.engine.tokenizer
            for choice, text, core in planned:
                if text is None and tokenizer is not None:
                    text = tokenizer.decode(core.prompt_token_ids)
                echo_texts[choice] = text or ""
        if body.stream:
            return sse_response(self._stream(request_id, model, planned, body, echo_texts))

        async def work() -> CompletionResponse:
            finals = await collect_outputs(self.ctx, planned, drop_completion=body.echo_only)
            return self._response(request_id, model, finals, body, echo_texts)

        response = await cancel_on_disconnect(raw_request, work)
        return JSONResponse(response.model_dump())

    def _response(self, request_id: str, model: str, finals: dict[int, RequestOutput], body: CompletionRequest,
                  echo_texts: dict[int, str]) -> CompletionResponse:
        choices = []
        for choice in sorted(finals):
            final = finals[choice]
            completion = final.outputs[0]
            logprobs = None
            if body.logprobs is not None:
                token_ids, entries = list(completion.token_ids), list(completion.logprobs or [])
                if body.echo:
                    token_ids, entries = with_prompt(final, token_ids, entries)
                logprobs, _ = completion_logprobs(entries, token_ids, 0, self.ctx.engine.tokenizer)
            with_ids = body.return_token_ids
            choices.append(CompletionResponseChoice(
                index=choice, text=echo_texts.get(choice, "") + completion.text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs_field(final),
                prompt_token_ids=list(final.prompt_token_ids) if with_ids else None,
                token_ids=list(completion.token_ids) if with_ids else None,
            ))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=make_usage(finals, body.n),
                                  kv_transfer_params=kv_transfer_params(finals))

    async def _stream(self, request_id: str, model: str, planned: list, body: CompletionRequest,
                      echo_texts: dict[int, str]) -> AsyncGenerator[str, None]:
        created = now_s()
        offsets: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        with_ids = body.return_token_ids
        async for d in stream_deltas(self.ctx, planned, finals, drop_completion=body.echo_only):
            completion = d.output.outputs[0]
            text, token_ids, entries = d.text, d.token_ids, d.logprobs
            if d.first and body.echo:  # the prompt (and its logprobs) in the choice's first chunk
                text = echo_texts.get(d.choice, "") + text
                if entries is not None:
                    token_ids, entries = with_prompt(d.output, token_ids, entries)
            logprobs = None
            if entries is not None:
                logprobs, offsets[d.choice] = completion_logprobs(entries, token_ids, offsets.get(d.choice, 0),
                                                                  self.ctx.engine.tokenizer)
            new_ids = with_ids and bool(d.token_ids)
            early = None if d.output.finished else d.output.kv_transfer_params  # chunked transfer's, before tokens
            if not text and not d.output.finished and logprobs is None and not new_ids and early is None:
                continue
            choice = CompletionResponseStreamChoice(
                index=d.choice, text=text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_token_ids=list(d.output.prompt_token_ids) if with_ids and d.first else None,
                token_ids=list(d.token_ids) if with_ids else None,
            )
            last = len(finals) == len(planned) and d.output.finished and not body.include_usage
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                               kv_transfer_params=kv_transfer_params(finals) if last else early))
        if body.include_usage:
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                               usage=make_usage(finals, body.n),
                                               kv_transfer_params=kv_transfer_params(finals)))
