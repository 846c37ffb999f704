"""Incremental detokenization and stop strings, one request at a time.

Text is produced with prefix-offset decoding (as vLLM and transformers' TextStreamer do): decode a
small window of recent tokens twice, with and without the newest ones, and emit the difference, but
only once it no longer ends in U+FFFD. With byte-level BPE one character can span several tokens;
its bytes are held back until the character is complete, so the streamed text equals the full
decode.

While running, streamed text stops short of the longest tail of the text that is a proper prefix of
some stop string, since a match would cut it off; once streamed, text is never taken back.

Without a tokenizer (token-id-only use) the text stays "" and stop strings are ignored: they can
only be matched against text.
"""

from __future__ import annotations

from typing import Any

from deltaserve.sampling_params import SamplingParams

# prompt tokens that seed the decode window, so the first output token decodes in context
# (leading-space handling in SentencePiece, a character split across the prompt's end)
INITIAL_DECODE_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feeds one request's output token ids and keeps its text, checking stop strings as it grows.

    `update()` returns the stop string that ended the text, else None. Once a stop string has
    matched, further tokens add no text.
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop: list[str] = list(params.stop or ()) if tokenizer is not None else []
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_string: str | None = None
        self.tokens_after_stop = 0  # of the last update's tokens, those after the one that completed a stop string
        self._last_output_text_offset = 0
        # with include_stop_str_in_output a match cuts after the stop string, which ends in the update
        # that finds it, so past anything streamed: nothing need be held back
        self._holds_back = bool(self.stop) and not params.include_stop_str_in_output
        # per stop string: the longest tail of output_text that is a proper prefix of it
        self._stop_prefix_lengths = [0] * len(self.stop)
        # output_text[:_stream_end] can be streamed while running; it only grows
        self._stream_end = 0
        # decode window: tokens[prefix_offset:read_offset] is text already emitted,
        # tokens[read_offset:] is held back until it decodes to complete characters
        self._tokens: list[str] = []
        self._prefix_offset = 0
        self._read_offset = 0
        if tokenizer is None:
            return
        self._is_fast = bool(getattr(tokenizer, "is_fast", False))
        self._added_vocab = set() if self._is_fast else set(tokenizer.get_added_vocab())
        self._special_tokens = set(tokenizer.all_special_tokens)
        tail = list(prompt_token_ids[-(INITIAL_DECODE_OFFSET + 2) :])
        self._tokens = self._to_tokens(tail)
        self._prefix_offset = max(len(self._tokens) - INITIAL_DECODE_OFFSET, 0)
        self._read_offset = len(self._tokens)

    # Public ----------------------------------------------------------------------------------
    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append `new_token_ids`; return the stop string that matched, else None.

        stop_terminated: the last id ended the request (EOS or a stop token id); as in vLLM its text
        is left out unless include_stop_str_in_output.
        On a match the text is cut before the stop string (after it with include_stop_str_in_output).
        Stop strings are looked for only once more than min_tokens tokens exist, and only over the
        new text plus the len(longest stop) - 1 characters before it, token by token: of several new
        tokens (a speculative run) those after the one that completes a match are not counted, and
        `tokens_after_stop` says how many there were.
        """
        self.tokens_after_stop = 0
        self.num_output_tokens += len(new_token_ids)
        if self.tokenizer is None or self.stop_string is not None:
            return None
        received = len(new_token_ids)
        if stop_terminated and new_token_ids and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        old_length = len(self.output_text)
        stop = None
        first_count = self.num_output_tokens - received  # tokens before this update
        for index, token_id in enumerate(new_token_ids):
            before = len(self.output_text)
            self.output_text += self._decode_next(token_id)
            # checked token by token: a stop string inside several new tokens (a speculative run) ends
            # the request at the token that completes it
            if self.stop and first_count + index + 1 > self.params.min_tokens:
                stop = self._check_stop_strings(len(self.output_text) - before)
                if stop is not None:
                    self.tokens_after_stop = received - index - 1
                    self.num_output_tokens -= self.tokens_after_stop
                    break
        if stop is not None or not self._holds_back:
            self._stream_end = len(self.output_text)  # after a match the (cut) text is final
        else:
            self._stream_end = len(self.output_text) - self._longest_stop_prefix(old_length)
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream now: all of it, or (delta) only what is new since the last call.

        While running, the longest tail of the text that is a proper prefix of some stop string is held
        back, since a match would cut it off; the text returned only ever grows.
        """
        end = len(self.output_text) if finished else self._stream_end
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if start < end:
            self._last_output_text_offset = end
            return self.output_text[start:end]
        return ""

    # Decoding --------------------------------------------------------------------------------
    def _to_tokens(self, ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(
            ids, skip_special_tokens=self.params.skip_special_tokens
        )
        return ["" if t is None else t for t in tokens]

    def _to_string(self, tokens: list[str]) -> str:
        if self._is_fast or not self._added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # slow tokenizers: added tokens bypass convert_tokens_to_string, as in transformers' decode
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if self.params.skip_special_tokens and token in self._special_tokens:
                continue
            if token in self._added_vocab:
                if run:
                    pieces.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.params.spaces_between_special_tokens else "").join(pieces)

    def _decode_next(self, token_id: int) -> str:
        self._tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing visible yet): wait for more tokens
        # the window only needs to start at what is now the prefix; drop the rest so it stays small
        del self._tokens[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    # Stop strings ----------------------------------------------------------------------------
    def _longest_stop_prefix(self, old_length: int) -> int:
        """Length of the longest tail of output_text that is a proper prefix of some stop string.

        old_length: len(output_text) before this update. Each stop string's tail is searched for from
        where its previous one began, so over a request each position is rejected at most once per
        stop string: per update, about one try per new character, each comparing fewer than len(stop)
        characters.
        """
        lengths = self._stop_prefix_lengths
        for i, stop in enumerate(self.stop):
            lengths[i] = self._stop_prefix_length(stop, old_length - lengths[i])
        return max(lengths)

    def _stop_prefix_length(self, stop: str, earliest: int) -> int:
        """Length of the longest tail of output_text that is a proper prefix of `stop`, or 0.

        earliest: where the previous such tail began. The part of the new tail that lies in the old
        text was such a tail then (or is empty), so the new one cannot begin earlier. A position that
        fails is never tried again, and each try compares fewer than len(stop) characters.
        """
        text = self.output_text
        start = max(earliest, len(text) - len(stop) + 1, 0)
        first = stop[0]
        position = text.find(first, start)
        while position != -1:
            if stop.startswith(text[position:]):
                return len(text) - position
            position = text.find(first, position + 1)
        return 0

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        text = self.output_text
        match: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(len(text) - new_char_count - len(stop) + 1, 0)
            index = text.find(stop, start)
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)  # the earliest match wins; ties go to the first listed
        if match is None:
            return None
        index, stop = match
        self.output_text = (
            text[: index + len(stop)] if self.params.include_stop_str_in_output else text[:index]
        )
        self.stop_string = stop
        return stop


def decode_logprobs(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each id decoded on its own, for Logprob.decoded_token (a partial character shows as U+FFFD)."""
    return [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]
