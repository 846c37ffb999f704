"""What the completions and chat handlers share: model names, fan-out of prompts x n into engine
requests, merging their output streams, disconnect handling, token budgets and usage."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from deltaserve.engine.async_llm import AsyncLLM, EngineDeadError
from deltaserve.engine.core import EngineCoreRequest
from deltaserve.entrypoints.openai.cpu_work import CpuWork
from deltaserve.entrypoints.openai.errors import OpenAIError, from_value_error
from deltaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    UsageInfo,
)
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass
class ServingContext:
    """What every handler needs: the engine client, the names it answers to, the pool for CPU-bound
    request work, and whether requests may bring their own chat template."""

    engine: AsyncLLM
    served_model_names: list[str]
    max_logprobs: int
    cpu_work: CpuWork
    trust_request_chat_template: bool = False

    def resolve_model(self, requested: str | None) -> str:
        """The name to echo back; None means the first served name. Unknown names are a 404."""
        if requested is None or requested in self.served_model_names:
            return requested or self.served_model_names[0]
        shown = requested.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates stay printable
        raise OpenAIError(f"The model `{shown}` does not exist.", 404, param="model", code="model_not_found")

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        """The request's SamplingParams (max_tokens is resolved per prompt later); a bad value is a 400."""
        try:
            return body.to_sampling_params(None, self.max_logprobs)
        except ValueError as e:
            raise from_value_error(e) from e


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """None is the room left in the context; more than that room is refused, naming the numbers.

    The prompt is already validated, so it leaves at least one token of room.
    """
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
            f"completion). Reduce the prompt or max_tokens.",
            400, param="max_tokens", code="context_length_exceeded",
        )
    return requested


def check_min_tokens(min_tokens: int, max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> None:
    """min_tokens cannot exceed the max_tokens the server settled on (asked for, or the room left)."""
    if min_tokens > max_tokens:
        raise OpenAIError(
            f"min_tokens={min_tokens} is more than the {max_tokens} tokens this request may generate "
            f"(max_model_len={max_model_len} with {num_prompt_tokens} prompt tokens, or the requested max)",
            400, param="min_tokens",
        )


MAX_CHOICES_PER_REQUEST = 1024
INLINE_WORK_CHARS = 8192  # longer prompts are tokenized (and templates rendered) in the CPU-work pool


async def plan_sub_requests(
    ctx: ServingContext, base_id: str, prompts: list[str | list[int]], params: SamplingParams, n: int,
    requested_max_tokens: int | None, arrival_time: float, prompt_param: str = "prompt",
) -> list[tuple[int, str | None, EngineCoreRequest]]:
    """Tokenize and validate every prompt, then fan out n samples of each. Raises OpenAIError (400)
    naming the field before anything reaches the engine. Returns (choice index, prompt text, request).

    With a seed, sample i of a prompt uses seed + i, so n > 1 gives n different, reproducible samples.
    """
    if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
        raise OpenAIError(
            f"{prompt_param}: {len(prompts)} prompts x n={n} asks for {len(prompts) * n} completions; at most "
            f"{MAX_CHOICES_PER_REQUEST} per request", 400, param=prompt_param,
        )
    planned = []
    for p_index, prompt in enumerate(prompts):
        args = (f"{base_id}-{p_index}", prompt, params, arrival_time)
        try:
            if isinstance(prompt, str) and len(prompt) > INLINE_WORK_CHARS:
                ctx.engine.processor.check_text_length(prompt)  # the cheap bound, before queueing any work
                text, core = await ctx.cpu_work.run("tokenizing the prompt", prompt_param, ctx.engine.process_input,
                                                    *args)
            else:
                text, core = ctx.engine.process_input(*args)
        except ValueError as e:
            err = from_value_error(e, prompt_param)
            if err.param in ("prompt", "prompt_token_ids"):
                err.param = prompt_param
            if len(prompts) > 1:
                err.message = f"{prompt_param}[{p_index}]: {err.message}"
            raise err from e
        max_tokens = resolve_max_tokens(requested_max_tokens, len(core.prompt_token_ids), ctx.engine.max_model_len)
        check_min_tokens(params.min_tokens, max_tokens, len(core.prompt_token_ids), ctx.engine.max_model_len)
        for sample in range(n):
            seed = None if params.seed is None else params.seed + sample
            sub_params = dataclasses.replace(params, max_tokens=max_tokens, seed=seed)
            sub = EngineCoreRequest(
                f"{base_id}-{p_index}-{sample}", core.prompt_token_ids, sub_params, max_tokens, arrival_time
            )
            planned.append((p_index * n + sample, text, sub))
    return planned


def prompt_only(output: RequestOutput) -> RequestOutput:
    """The output of an echo request with max_tokens=0, which the engine ran with max_tokens=1 (it
    cannot generate nothing): the same with that one token dropped, finished by length."""
    completion = dataclasses.replace(
        output.outputs[0], text="", token_ids=[], logprobs=[] if output.outputs[0].logprobs is not None else None,
        cumulative_logprob=0.0 if output.outputs[0].cumulative_logprob is not None else None,
        finish_reason="length" if output.finished else None, stop_reason=None,
    )
    return dataclasses.replace(output, outputs=[completion])


async def stream_outputs(ctx: ServingContext, planned: list[tuple[int, str | None, EngineCoreRequest]],
                         drop_completion: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every sub-request and yield (choice index, cumulative output) as outputs arrive; with
    `drop_completion` (echo with max_tokens=0), each output is `prompt_only` of itself.

    Leaving early (disconnect, cancellation) closes every generator, which aborts what is unfinished.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: int, text: str | None, core: EngineCoreRequest) -> None:
        gen = ctx.engine.generate_processed(text, core)
        try:
            async with contextlib.aclosing(gen):
                async for output in gen:
                    queue.put_nowait((choice, output))
        except Exception as e:  # hand it to the consumer, which raises it
            queue.put_nowait((choice, e))
        finally:
            queue.put_nowait((choice, done))

    tasks = [asyncio.create_task(pump(*item)) for item in planned]
    remaining = len(tasks)
    try:
        while remaining:
            choice, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise _as_openai_error(item)
            else:
                yield choice, prompt_only(item) if drop_completion else item
    finally:
        for task in tasks:
            task.cancel()


def _as_openai_error(e: Exception) -> Exception:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"the engine is not available: {e}", 503, type_="service_unavailable")
    if isinstance(e, ValueError):
        return from_value_error(e)
    return e


@dataclass
class Delta:
    """What is new in one choice since the last delta: text, token ids and their logprob entries."""

    choice: int
    output: RequestOutput
    text: str
    token_ids: list[int]
    logprobs: list | None
    first: bool


async def stream_deltas(ctx: ServingContext, planned: list[tuple[int, str | None, EngineCoreRequest]],
                        finals: dict[int, RequestOutput], drop_completion: bool = False) -> AsyncIterator[Delta]:
    """`stream_outputs` as per-choice deltas; each choice's final output is also put in `finals`."""
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    async for choice, output in stream_outputs(ctx, planned, drop_completion):
        completion = output.outputs[0]
        first = choice not in sent_text
        text = completion.text[sent_text.get(choice, 0):]
        start = sent_tokens.get(choice, 0)
        sent_text[choice], sent_tokens[choice] = len(completion.text), len(completion.token_ids)
        if output.finished:
            finals[choice] = output
        logprobs = completion.logprobs[start:] if completion.logprobs is not None else None
        yield Delta(choice, output, text, completion.token_ids[start:], logprobs, first)


_TOKEN_ID_FIELDS = {"prompt_token_ids", "token_ids"}


def sse(payload: Any, token_ids: bool = True) -> str:
    """One server-sent event carrying a pydantic model. A null `kv_transfer_params` (set on a stream's
    last chunk, and on a chunked-transfer producer's first) is left out, and so are the choices'
    token-id fields when `token_ids` is False."""
    exclude: dict[str, Any] = {}
    if "kv_transfer_params" in type(payload).model_fields and payload.kv_transfer_params is None:
        exclude["kv_transfer_params"] = True
    if not token_ids:
        exclude["choices"] = {"__all__": _TOKEN_ID_FIELDS}
    return f"data: {payload.model_dump_json(exclude=exclude or None)}\n\n"


def kv_transfer_params(finals: dict[int, RequestOutput]) -> dict[str, Any] | None:
    """A response's top-level kv_transfer_params: those of its first choice that has any (a P/D
    producer's finished output carries them; one prompt, and in practice n=1, under P/D)."""
    for choice in sorted(finals):
        if finals[choice].kv_transfer_params is not None:
            return finals[choice].kv_transfer_params
    return None


def sse_response(events: AsyncGenerator[str, None]) -> StreamingResponse:
    """Stream `events`, then "[DONE]"; an OpenAIError raised mid-stream is sent as an error event first."""

    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except OpenAIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def collect_outputs(ctx: ServingContext, planned: list[tuple[int, str | None, EngineCoreRequest]],
                          drop_completion: bool = False) -> dict[int, RequestOutput]:
    """Run every sub-request to its end; the final output of each choice."""
    final: dict[int, RequestOutput] = {}
    async for choice, output in stream_outputs(ctx, planned, drop_completion):
        if output.finished:
            final[choice] = output
    return final


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()` (a non-streaming handler body) unless the client leaves first; then cancel it,
    which aborts its engine requests, and answer nothing (there is no one left to answer)."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise OpenAIError("client disconnected", 499)
    return task.result()


def make_usage(finals: dict[int, RequestOutput], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample); cached tokens are the best of its samples."""
    prompt_tokens = cached = completion = 0
    by_prompt: dict[int, list[RequestOutput]] = {}
    for choice, output in finals.items():
        by_prompt.setdefault(choice // n, []).append(output)
        completion += len(output.outputs[0].token_ids)
    for outputs in by_prompt.values():
        prompt_tokens += len(outputs[0].prompt_token_ids)
        cached += max(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
