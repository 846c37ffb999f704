"""The two legs of a P/D request as plain dicts: what the prefill server is sent, what the decode
server is sent once the prefill answered, and the OpenAI error a failed leg turns into.

Prefill leg: the client's body with max_tokens 1 (max_completion_tokens 1 too, when the chat body has
it), stream true, return_token_ids true, kv_transfer_params {"do_remote_decode": true}; min_tokens and
stream_options are dropped, n is kept. Its events are read into a `PrefillAnswer`: the prompt's token
ids and the producer's kv_transfer_params, which a chunked-transfer producer sends in its first event
(the decode leg starts then, while the prefill runs) and any other in its last. Decode leg: the
client's body with the prefill's kv_transfer_params and its prompt as token ids (`prompt` for
completions, `prompt_token_ids` for chat, so no chat template is rendered twice).
"""

from __future__ import annotations

from typing import Any

import httpx

from deltaserve.entrypoints.openai.errors import OpenAIError

COMPLETIONS, CHAT = "completions", "chat"
ENDPOINT_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


def check_body(endpoint: str, body: Any) -> dict[str, Any]:
    """The client's body, if the proxy can split it into legs; else a 400 naming the field. Everything
    else is the backends' to validate (their 400 reaches the client)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object", 400)
    prompt = body.get("prompt")
    if endpoint == COMPLETIONS and isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        raise OpenAIError(f"prompt: the P/D proxy serves one prompt per request (got {len(prompt)}); send them "
                          "as separate requests", 400, param="prompt")
    if body.get("kv_transfer_params") is not None:
        raise OpenAIError("kv_transfer_params: the P/D proxy sets it; leave it out", 400,
                          param="kv_transfer_params")
    return body


def prefill_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill server is sent: compute the prompt, one token, keep the state for a decode."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=True, return_token_ids=True, kv_transfer_params={"do_remote_decode": True})
    if endpoint == CHAT and "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


class PrefillAnswer:
    """What the prefill leg's server-sent events said: `add` each event's JSON; `early` once a
    chunked-transfer producer has given its params and the prompt (the decode leg may start)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prompt_token_ids: list[int] | None = None
        self.kv_transfer_params: dict[str, Any] | None = None

    def add(self, event: Any) -> None:
        """One event's JSON; an error event raises its OpenAIError (a 502 naming the prefill leg)."""
        if not isinstance(event, dict):
            return
        error = event.get("error")
        if isinstance(error, dict):
            raise OpenAIError(f"prefill leg ({self.url}) failed: {error.get('message', error)}", 502,
                              code="prefill_failed", type_="server_error")
        if isinstance(event.get("kv_transfer_params"), dict):
            self.kv_transfer_params = event["kv_transfer_params"]
        if self.prompt_token_ids is None:
            for choice in event.get("choices") or []:
                ids = choice.get("prompt_token_ids") if isinstance(choice, dict) else None
                if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
                    self.prompt_token_ids = ids
                    break

    @property
    def early(self) -> bool:
        params = self.kv_transfer_params
        return params is not None and bool(params.get("chunked")) and self.prompt_token_ids is not None

    def as_response(self) -> dict[str, Any]:
        """The answer shaped as a non-streamed one (what `decode_body` reads)."""
        choices = [] if self.prompt_token_ids is None else [{"index": 0, "prompt_token_ids": self.prompt_token_ids}]
        return {"choices": choices, "kv_transfer_params": self.kv_transfer_params}


def prompt_token_ids(response: dict[str, Any], url: str) -> list[int]:
    """The prompt's token ids from a prefill answer (its first choice's `prompt_token_ids`)."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = min(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        ids = first.get("prompt_token_ids")
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return ids
    raise OpenAIError(f"prefill leg ({url}): the answer has no choices[0].prompt_token_ids; is the prefill server "
                      "a deltaserve (or vLLM) that honours return_token_ids?", 502, code="prefill_bad_response")


def decode_body(endpoint: str, body: dict[str, Any], prefill: dict[str, Any], url: str) -> dict[str, Any]:
    """What the decode server is sent, given the prefill server's answer (from `url`)."""
    ids = prompt_token_ids(prefill, url)
    leg = dict(body, kv_transfer_params=prefill.get("kv_transfer_params"))
    if endpoint == COMPLETIONS:
        leg["prompt"] = ids
    else:
        leg["prompt_token_ids"] = ids
    return leg


def _error_fields(response: httpx.Response) -> tuple[str, str | None, str | None, Any]:
    """(message, type, param, code) of a backend's error answer, OpenAI-shaped or not."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"], error.get("type"), error.get("param"), error.get("code")
    text = response.text.strip()[:500] or response.reason_phrase
    return text, None, None, None


def leg_failed(leg: str, url: str, response: httpx.Response) -> OpenAIError:
    """A leg's error answer: a 4xx reaches the client as it is (the request's fault); a 5xx is a 502."""
    message, type_, param, code = _error_fields(response)
    if response.status_code < 500:
        return OpenAIError(f"{leg} leg ({url}): {message}", response.status_code, param=param, code=code,
                           type_=type_)
    return OpenAIError(f"{leg} leg ({url}) failed with {response.status_code}: {message}", 502,
                       code=f"{leg}_failed", type_="server_error")


def leg_unreachable(leg: str, url: str, exc: httpx.HTTPError) -> OpenAIError:
    """A leg that got no answer: 504 when it timed out, 502 when the backend could not be reached."""
    if isinstance(exc, httpx.TimeoutException):
        return OpenAIError(f"{leg} leg ({url}) timed out: {type(exc).__name__}", 504, code=f"{leg}_timeout",
                           type_="server_error")
    detail = str(exc) or type(exc).__name__
    return OpenAIError(f"{leg} leg ({url}) is unreachable: {detail}", 502, code=f"{leg}_unreachable",
                       type_="server_error")
