"""What a model drafter on the output rank knows of each request's tokens, learnt from the steps it sees."""

from __future__ import annotations

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.worker.runner_output import ModelRunnerOutput


class KnownTokens:
    """Every request's prompt and output tokens so far (prompt + outputs, as the scheduler has them)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def note_step(self, scheduler_output: SchedulerOutput) -> None:
        """Prompts of new requests, forget finished ones, and any token a chunk brings first (a P/D
        consumer's first token, which its producer sampled)."""
        for request_id in scheduler_output.finished_request_ids:
            self.tokens.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids)
        for chunk in scheduler_output.chunks:
            known = self.tokens.setdefault(chunk.request_id, [])
            tokens = chunk.token_ids[:1] if chunk.is_verify else chunk.token_ids  # a window's drafts are guesses
            for position, token in enumerate(tokens, start=chunk.num_computed_tokens):
                if position == len(known):
                    known.append(token)

    def note_output(self, output: ModelRunnerOutput) -> None:
        """Append each request's sampled token and, after a verify window, its further accepted tokens."""
        for request_id, token in zip(output.request_ids, output.sampled_token_ids, strict=True):
            self.tokens[request_id] += [token, *output.extra_token_ids.get(request_id, [])]

    def __getitem__(self, request_id: str) -> list[int]:
        return self.tokens[request_id]
