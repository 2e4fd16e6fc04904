"""Incremental detokenization with stop strings.

Each step decodes only a small window of token ids (vLLM's / TGI's prefix-offset, read-offset scheme):
``ids[prefix_offset:read_offset]`` were already turned into text and are decoded again only as context,
so that a token's leading space ('▁' in sentencepiece, 'Ġ' in byte-level BPE) and characters split
across byte tokens come out as ``tokenizer.decode`` of the whole sequence would give them. The window
starts on the last few prompt tokens, so the first output token's leading space is kept.

Text is released in two stages: decoded text that ends in U+FFFD (a multi-byte character still
missing bytes) is held until the character completes; of the decoded text, a tail that could be the
start of a stop string is held until it either completes the stop string (the request stops; the
text is cut before it, or after it with ``include_stop_str_in_output``) or can no longer match.
``finish()`` releases both when the request ends for another reason.

With a fast tokenizer the window runs inside the tokenizers library (``DecodeStream``: one call per token
instead of two window decodes and their list slices, 10x less time, the worker front's top cost at 512
streams); the windows it decodes are the same, and this class still tracks their offsets, so ``finish``
can flush an incomplete character with one window decode.
"""

from __future__ import annotations

from typing import Any, cast

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from engine.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM uses 5 as well): enough for
# a sentencepiece or byte-level decoder to see that the first output token is not at text start.
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
USE_DECODE_STREAM = True  # False: the window decodes in Python (what a slow tokenizer gets; tests check both)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive and watches for stop strings.

    ``output_text`` is only ever extended (never revised), so callers may stream its growth.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # tokenizers.Tokenizer of a fast tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_reason: str | None = None  # the stop string that ended the output, if one did
        self.is_finished = False

        context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: its bytes would merge into the output's
        self._token_ids = context  # the prompt context, then every output token
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(context)  # ids before this are already in _text
        self._text = ""  # decoded text, stop-string tail included
        self._num_visible_chars = 0  # _text[:this] is output_text
        self._num_taken_chars = 0  # for take_new_text()
        self._stream: Any = None
        if self._backend is not None and USE_DECODE_STREAM:
            self._stream = DecodeStream(context, skip_special_tokens=self.skip_special_tokens)

    @property
    def output_text(self) -> str:
        """The text safe to show so far: no partial stop string, no incomplete character."""
        return self._text[: self._num_visible_chars]

    def take_new_text(self) -> str:
        """The part of ``output_text`` not returned by an earlier call (for streaming deltas)."""
        new_text = self._text[self._num_taken_chars : self._num_visible_chars]
        self._num_taken_chars = self._num_visible_chars
        return new_text

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append output tokens. Returns the stop string if one now matched (the output then ends;
        later calls are ignored), else None."""
        if self.is_finished:
            return None
        if self._stream is None:
            self._token_ids.extend(token_ids)
            return self._append_text(self._decode_new_text(flush=False))
        chunks = []
        for token_id in token_ids:
            self._token_ids.append(token_id)
            chunk = self._stream.step(self._backend, token_id)
            if chunk is not None:  # the stream moved its window as _decode_new_text would
                self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
                chunks.append(chunk)
        return self._append_text("".join(chunks)) if chunks else None

    def finish(self) -> None:
        """The request ended for another reason (EOS, length, abort): release all held-back text."""
        if self.is_finished:
            return
        self._append_text(self._decode_new_text(flush=True))
        self._num_visible_chars = len(self._text)
        self.is_finished = True

    # ---- decoding --------------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across window edges (" ." -> "."),
        # which would make the windows disagree with each other. A fast tokenizer's Rust backend decodes
        # the same text without transformers' per-call Python overhead (6x less time per token).
        if self._backend is not None:
            return cast(str, self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens))
        text = self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return cast(str, text)  # a list of ids decodes to one str

    def _decode_new_text(self, flush: bool) -> str:
        """Text for the ids from ``_read_offset`` on, decoded in the context of the previous window.
        Empty while it ends in an incomplete character (unless ``flush``)."""
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. skipped special tokens only
        if full_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    # ---- stop strings ----------------------------------------------------------------------------

    def _append_text(self, new_text: str) -> str | None:
        if not new_text:
            return None
        num_old_chars = len(self._text)
        self._text += new_text
        if not self.stop_strings:  # (the common case: nothing to hold back)
            self._num_visible_chars = len(self._text)
            return None
        match = self._find_stop(num_old_chars)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else start
            self._text = self._text[:end]
            self._num_visible_chars = end
            self.stop_reason = stop
            self.is_finished = True
            return stop
        # a held tail can only shrink relative to the text, so this never moves backwards
        num_visible = len(self._text) - self._num_held_back_chars()
        self._num_visible_chars = max(self._num_visible_chars, num_visible)
        return None

    def _find_stop(self, num_old_chars: int) -> tuple[int, str] | None:
        """The stop string that completes first in the text added after ``num_old_chars``.

        "First" is by the position of its last character (then the longest), which is what a
        character-by-character stream would see, so the result does not depend on how the text
        was split into tokens. Only the new text and a stop-length tail before it are searched.
        """
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stop_strings:
            start = self._text.find(stop, max(0, num_old_chars - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, neg_length, stop = best
        return end + neg_length, stop

    def _num_held_back_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        num_held = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(self._text)), num_held, -1):
                if self._text.endswith(stop[:length]):
                    num_held = length
                    break
        return num_held
